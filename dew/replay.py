"""Training a recorded run again, bit for bit, without its rollout.

``replay(trainer, record, checkpoints=...)`` takes a :class:`~dew.trainer.Trainer` built as
the run built its own (the same objective, pretrained weights, optimizer, key and mesh; its
rollout, servers and sandboxes are never called) and the run's record
(:mod:`dew.update_record`). From the trainer's initial state, which must be the run's start
(its parameters' digest is checked first), it trains each recorded batch in order with
:meth:`Trainer.update`; a step the run made no update in only advances the step. After every
update the parameters' digest is compared with the one the run recorded, and at every step
the run's checkpoint folder still holds, the replayed parameters and optimizer state are
compared with the checkpoint's, leaf by leaf, bit for bit. The report names the first step
where they differ (replay stops there) or says they never did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from dew.checkpoint import Checkpoints
from dew.trainer import Trainer, TrainState
from dew.update_record import RecordError, UpdateRecord, params_digest


@dataclass
class ReplayReport:
    """What a replay found.

    steps: recorded steps replayed; updates: of those, steps that made an update;
    first_mismatch: the first step (counted from 0) whose replayed parameters differ from the
    record's, or None; mismatch: what differed there; checkpoints: each checkpoint compared
    (its step, the number of batches consumed) and whether it was equal bit for bit;
    seconds: the replay's wall time.
    """

    steps: int = 0
    updates: int = 0
    first_mismatch: int | None = None
    mismatch: str = ""
    checkpoints: dict[int, bool] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return self.first_mismatch is None and all(self.checkpoints.values())

    def describe(self) -> str:
        checked = ", ".join(f"{step} {'equal' if same else 'DIFFERENT'}" for step, same in self.checkpoints.items())
        head = (f"replayed {self.steps} steps ({self.updates} updates) in {self.seconds:.1f} s; checkpoints compared "
                f"bit for bit: {checked or 'none left in the run'}")
        if self.first_mismatch is None:
            return head + "; every update's parameters equal the record's"
        return head + f"; first difference at step {self.first_mismatch}: {self.mismatch}"


def replay(trainer: Trainer, record: str | Path | UpdateRecord, checkpoints: str | Path | None = None,
           until: int | None = None) -> ReplayReport:
    """Train ``record``'s batches again on ``trainer`` from its initial state (see the module docstring).

    ``checkpoints``: the run's checkpoint folder (its ``output_dir``), compared at every step it
    holds; ``until``: replay only the first ``until`` steps.
    """
    record = record if isinstance(record, UpdateRecord) else UpdateRecord(record)
    started = time.perf_counter()
    start = record.start()
    mesh = {name: int(size) for name, size in trainer.mesh.shape.items()}
    if start["devices"] != jax.device_count() or start["mesh"] != mesh:
        raise RecordError(f"{record.directory} was recorded on {start['devices']} device(s) with mesh {start['mesh']}; "
                          f"this trainer has {jax.device_count()} with mesh {mesh}: replay on the run's layout (a "
                          "different one sums in another order)")
    state = trainer.initial_state()
    if params_digest(state.params) != start["params_digest"]:
        raise ValueError("the trainer's initial parameters are not the run's start (their digests differ): build the "
                         "Trainer as the run built it, with the same objective, pretrained weights and key")
    saved = set()
    if checkpoints is not None and Path(checkpoints).exists():
        folder = Checkpoints(checkpoints, keep=None)
        try:
            saved = set(folder.all_steps())
        finally:
            folder.close()
    report = ReplayReport()
    for recorded in record.steps(until):
        if int(state.updates) != recorded.updates:
            raise RecordError(f"{recorded.path}: step {recorded.step} was taken after {recorded.updates} updates, the "
                              f"replay has made {int(state.updates)} (the record's steps do not follow each other)")
        report.steps += 1
        if recorded.batch is None:
            state = state.replace(step=state.step + 1)
        else:
            state, _ = trainer.update(state, recorded.batch)
            report.updates += 1
            if params_digest(state.params) != recorded.params_digest:
                report.first_mismatch, report.mismatch = recorded.step, "the parameters' digest differs from the record's"
                break
        if recorded.step + 1 in saved:
            difference = _compare(trainer, state, checkpoints, recorded.step + 1)
            report.checkpoints[recorded.step + 1] = difference is None
            if difference is not None:
                report.first_mismatch, report.mismatch = recorded.step, difference
                break
    report.seconds = time.perf_counter() - started
    return report


def _compare(trainer: Trainer, state: TrainState, checkpoints: str | Path, step: int) -> str | None:
    """None when the checkpoint of ``step`` holds exactly ``state``'s parameters and optimizer state, else which leaf
    differs first."""
    saved, _ = trainer.restore(checkpoints, step)
    for part in ("params", "opt_state"):
        mine, theirs = getattr(state, part), getattr(saved, part)
        for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(mine)[0],
                                     jax.tree_util.tree_flatten_with_path(theirs)[0], strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return f"checkpoint {step}: {part}{jax.tree_util.keystr(path)} differs"
    return None
