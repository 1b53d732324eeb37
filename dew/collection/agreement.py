"""Where the schedulers of a multi-process trainer meet: the weight push, the admission, the rescoring.

Every trainer process runs its own :class:`~dew.collection.scheduler.RolloutScheduler`;
each call meets the other processes' calls, in the same order on every process, here:

- :meth:`ProcessAgreement.meet`, at the first call: the served version and the options
  that must match;
- :meth:`ProcessAgreement.push`: every process gathers the variables to host memory
  collectively, loads where ``push`` says ("one": process 0, "each": every process), and
  the processes exchange the outcome, so a failed or stuck push raises everywhere;
- :meth:`ProcessAgreement.together`: whether each process's admission succeeded, and the
  union of the fields they packed (a process without a trainable row contributes N masked
  rows; ``session_index`` is offset by the sessions of the processes before it);
- :meth:`ProcessAgreement.rescore`: one jitted rescoring over the global batch on the
  trainer's mesh, from which each process takes back its own rows.
"""

from __future__ import annotations

import jax
import numpy as np

from dew.data.dataset import Batch
from dew.inference.publisher import WeightPublisher
from dew.records.session_packing import pack
from dew.sharding import (
    collective_host,
    describe_error,
    mesh_of,
    exchange,
    process_rows,
    raise_failures,
    row_sharded,
    shard_batch,
)

RESCORED = ("input_ids", "text_segment_ids", "text_positions", "text_prefix_segments", "support_ids",
            "support_columns")
_PADDING = {"support_ids": -1, "support_columns": -1}  # pack's fill for the fields it adds only with supports


class ProcessAgreement:
    """One scheduler's side of the meetings with the other trainer processes (see the module docstring).

    ``weights``: the publisher this process loads when ``push`` says it does; ``options``:
    what every process's scheduler must share; ``agreed`` is the served version every
    process agreed on (None before the first meeting).
    """

    def __init__(self, weights: WeightPublisher, push: str, options: dict):
        self.weights, self.push, self.options = weights, push, options
        self.agreed: int | None = None
        self._rescore: dict = {}  # mesh -> packed_log_probs jitted to return row-sharded scores

    @property
    def loads_here(self) -> bool:
        return self.push == "each" or jax.process_index() == 0

    def meet(self) -> None:
        """The first call: agree on the served version and check the shared options."""
        options = self.options
        served = int(self.weights.version) if self.loads_here else None
        everyone = exchange({"options": options, "served": served})
        for process, theirs in enumerate(everyone):
            if theirs["options"] != options:
                raise ValueError(
                    f"RolloutScheduler options differ across processes: process {jax.process_index()} has {options}, "
                    f"process {process} has {theirs['options']}; every process must build the scheduler alike"
                )
        versions = {p: theirs["served"] for p, theirs in enumerate(everyone) if theirs["served"] is not None}
        if len(set(versions.values())) > 1:
            raise ValueError(
                f"with push='each' every process's weights must start at the same version; they serve {versions} "
                "(process: version)"
            )
        self.agreed = next(iter(versions.values()))

    def push_weights(self, variables, version: int, before: int) -> bool:
        """Every process calls: gather to host, load where ``push`` says, agree on the outcome."""
        host = collective_host(variables)
        for attempt in range(2):
            error, served = None, None
            if self.loads_here:
                try:
                    if attempt == 0 or int(self.weights.version) != version:
                        self.weights.load(host, version)
                    served = int(self.weights.version)
                except Exception as caught:  # told to every process below, then raised here
                    error = caught
            everyone = exchange({"error": describe_error(error), "served": served})
            raise_failures(everyone, error, f"the weight push for version {version}")
            stuck = {p: theirs["served"] for p, theirs in enumerate(everyone)
                     if theirs["served"] is not None and theirs["served"] != version}
            if not stuck:
                self.agreed = version
                return True
        where = ", ".join(f"{served} on process {p}" for p, served in stuck.items())
        raise RuntimeError(
            f"pushing weights for version {version} left the served version at {where} (was {before}) after two tries"
        )

    def failed(self, error: BaseException, version: int) -> None:
        """This process's admission raised: tell the others, then raise (this process raises its own error)."""
        everyone = exchange({"error": describe_error(error)})
        raise_failures(everyone, error, f"rollout admission for update {version}")

    def together(self, out: Batch | None, sessions: int, version: int, *, width: int, rows: int, estimator: str,
                 truncation: str) -> Batch | None:
        """Agree with the other processes on this step's batch; returns this process's rows of it, or None.

        ``out`` is this process's packed batch when it has a trainable row. Every process
        returns None when none has one; otherwise a process without one contributes N
        masked rows, and every process's rows carry the union of the packed fields.
        """
        mine = {} if out is None else {k: [str(np.asarray(v).dtype), list(np.shape(v)[1:])]
                                       for k, v in out.items() if k != "old_log_probs"}
        everyone = exchange({"error": None, "sessions": sessions, "fields": mine})
        raise_failures(everyone, None, f"rollout admission for update {version}")
        fields: dict[str, list] = {}
        for process, theirs in enumerate(everyone):
            for name, spec in theirs["fields"].items():
                if fields.setdefault(name, spec) != spec:
                    raise ValueError(
                        f"the processes packed field {name!r} differently at update {version} "
                        f"([dtype, trailing shape]): {fields[name]} before process {process}, {spec} on it"
                    )
        if not fields:
            return None  # no process has a trainable row: every process skips the update
        if out is None:  # pack's own padding for the standard fields, no sessions in them
            out = pack([], width, rows=rows, estimator=estimator, truncation=truncation)
        else:
            out = dict(out)
        for name, (dtype, shape) in fields.items():
            if name not in out:
                out[name] = np.full((rows, *shape), _PADDING.get(name, 0), np.dtype(dtype))
        # session_index must name sessions across the global batch (the session-mean aggregation counts them).
        offset = sum(theirs["sessions"] for theirs in everyone[: jax.process_index()])
        index = np.asarray(out["session_index"])
        out["session_index"] = np.where(index >= 0, index + offset, index).astype(index.dtype)
        return out

    def rescore(self, packed_log_probs, variables, fields: dict[str, np.ndarray]) -> np.ndarray:
        """``packed_log_probs`` over every process's rows at once; returns this process's rows of the scores."""
        mesh = mesh_of(variables)
        if mesh not in self._rescore:
            self._rescore[mesh] = jax.jit(packed_log_probs, out_shardings=row_sharded(mesh))
        return process_rows(self._rescore[mesh](variables, shard_batch(fields, mesh)))
