"""RolloutScheduler: the Trainer's rollout for any SessionSource, with batches in flight ahead.

``RolloutScheduler(objective, source, weights, width=W, rows=N, groups=G, ...)`` is a
:class:`~dew.trainer.Rollout`. Train on ``scheduler.tasks(dataset)`` with
``Trainer(..., rollout=scheduler)``: each task of a data batch becomes one group of G
rollouts, and the scheduler returns the group-relative ``[N, W]`` GRPO batch.

Reading ahead. The Trainer does not prefetch: it reads batch i, then steps on it. So
the stream ``scheduler.tasks(dataset)`` returns reads up to ``ahead`` batches beyond the
one it hands over, registers each with the scheduler as it reads it, and hands them back
in order. When the trainer passes batch i to the scheduler, batches i + 1 .. i + ahead
are submitted under the version the weights serve at that moment. The checkpointed data
position stays the trainer's: when the wrapped stream reports positions
(:class:`~dew.data.dataset.StreamPosition`), the wrapper reports the position of the
next batch it will *hand over*, not of the next it will read; otherwise the trainer
resumes by skipping batches, which is exact for deterministic streams. Opening the
stream again (a restart) cancels whatever the previous stream left in flight. A resumed
run resubmits the batches it re-reads.

Admission by status (``truncation`` is pack's option):

- COMPLETED, AGENT_ERROR: admitted with their reward;
- TRUNCATED: completes its group and trains as ``truncation`` says; under "score" one
  without a reward is submitted again as a failed attempt (its verifier never ran);
- INFRA_ERROR, CANCELLED: submitted again under the served weights; after
  ``max_attempts`` failures of one sample its group is abandoned;
- a rollout whose oldest call is more than ``max_lag`` updates behind the trainer is
  discarded and submitted again; one still running that was submitted more than
  ``max_lag`` updates ago is cancelled without being waited on and submitted again;
- ``timeout=S``: a rollout running S seconds after submission is cancelled and
  submitted again as a failed attempt.

``oversample=K`` submits G + K samples per group and admits the first G to finish;
``admit=M`` admits the first M groups of a batch to complete and cancels the rest. A
complete group is admitted only if its chains fit N rows beside the groups admitted
before it (otherwise it is *cut*); a group that cannot fit N rows on its own raises.
``old_log_probs`` is rescored under the trainer's current variables (the proximal
policy); ``behavior_log_probs`` stays as the engine reported it.

Multi-process trainers. Every trainer process runs its own scheduler, on its own source,
over the task rows its partition of the data stream reads, and packs its own N rows; the
step's batch is every process's rows together (the Trainer shards the returned rows as
it shards any batch), so no rollout crosses a process. Each scheduler call meets the
other processes' calls, in the same order on every process, at three points:

- the weight push. Every process decides alike (the served version is one every process
  agreed on) and gathers the variables to host memory collectively; ``push="one"``
  (default) has process 0 call ``weights.load``: one engine pool serves every process's
  source. ``push="each"`` has every process load its own ``weights``: each process's
  source has an engine of its own (a NativeRolloutServer per process). The processes
  then exchange the outcome, so every process sees the same served version and a push
  that fails or does not move the version raises on every process;
- the admission. Before the rescoring the processes exchange whether their admission
  succeeded; a failure on any process (a source that raised, a group that cannot fit N
  rows, a converter error) raises on every process, naming the process and its cause
  (the failing process raises its own error), rather than leave the others waiting in
  the rescoring. When no process has a trainable row, every process returns None and
  the step makes no update; when only some do, the others contribute N fully masked
  rows. ``session_index`` is offset by the sessions of the processes before this one,
  and a field one process packed (supports, router records) is padded on the others,
  so the global batch is laid out as one pack of every process's groups would be;
- the proximal rescoring, one jitted computation over the global batch on the
  trainer's mesh, from which each process takes back its own rows.

Construction makes no collective call; the first scheduler call agrees on the served
version and checks that ``rows``, ``width``, ``sync_every`` and ``push`` match across
processes. A source that never resolves still blocks every process (use ``timeout``).
Each process logs its own :class:`SchedulerRecord`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dew.data.dataset import Batch, Dataset, StreamPosition
from dew.data.prompts import METADATA, metadata_texts, prompt_rows
from dew.objectives.rl.sessions import (
    ESTIMATORS,
    TRUNCATIONS,
    Session,
    SessionSource,
    Status,
    Task,
    chain_lengths,
    pack,
    rows_needed,
    session_metrics,
)
from dew.sharding import (
    DATA_AXIS,
    collective_host,
    data_mesh,
    describe_error,
    exchange,
    process_rows,
    raise_failures,
    row_sharded,
    shard_batch,
)

logger = logging.getLogger(__name__)

_POLL = 0.05  # seconds between checks of timeouts while waiting on rollouts
PUSHES = ("one", "each")


# ----- converting data batches to tasks --------------------------------------------------------


def task_ids(batch: Batch) -> list[Task]:
    """Tasks from integer ``task_id`` rows: ``Task(str(id), {"task_id": id})``."""
    if "task_id" not in batch:
        raise KeyError(f"task_ids needs a 'task_id' field; the batch has {sorted(batch)}")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"task_id must be a [rows] integer array, got shape {ids.shape} dtype {ids.dtype}")
    return [Task(str(int(i)), {"task_id": int(i)}) for i in ids]


def prompt_tasks(batch: Batch) -> list[Task]:
    """Tasks from Prompts rows: left-padded ``prompt``, ``prompt_length`` and the UTF-8 reward fields.

    Each task's data holds ``prompt_ids`` and the reward fields as strings; its id is a
    checksum of the prompt and its fields (advantages group by the scheduler's group id).
    """
    rows = prompt_rows(batch, "prompt_tasks")
    texts = {field: metadata_texts(batch, field, len(rows)) for field in METADATA}
    tasks = []
    for row, ids in enumerate(rows):
        data: dict[str, Any] = {"prompt_ids": ids, **{field: texts[field][row] for field in METADATA}}
        digest = zlib.crc32(repr((ids, [data[f] for f in METADATA])).encode())
        tasks.append(Task(f"prompt-{digest:08x}", data))
    return tasks


def _infer_tasks(batch: Batch) -> list[Task]:
    if "task_id" in batch:
        return task_ids(batch)
    if "prompt" in batch:
        return prompt_tasks(batch)
    raise KeyError(f"cannot tell the batch's tasks: it has neither 'task_id' nor 'prompt' (fields {sorted(batch)}); "
                   "pass tasks=task_ids, tasks=prompt_tasks or your own converter")


# ----- the record ------------------------------------------------------------------------------


@dataclasses.dataclass
class SchedulerRecord:
    """What one scheduler call did (see the module docstring).

    version: the trainer's version; oldest_version and lag: of the oldest call among
    admitted rollouts (None without any); resubmissions: count by cause ("infra_error",
    "cancelled", "unscored_truncation", "stale", "stale_running", "timeout");
    cancellations: futures cancelled (timeouts, staleness, oversample extras, admit,
    abandonment); waited: seconds spent waiting on rollouts; pushed: whether this call
    pushed weights; metrics: ``session_metrics`` over the admitted rollouts and their batch.
    """

    version: int
    oldest_version: int | None
    lag: int | None
    admitted_groups: int
    resubmissions: dict[str, int]
    cancellations: int
    abandoned_groups: int
    cut_groups: int
    waited: float
    pushed: bool
    metrics: dict[str, float]


# ----- bookkeeping -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    """One sample of a group: its live future, when and under which version it went out, its failures."""

    sample: int
    future: Future | None = None
    submitted: float = 0.0
    version: int = 0
    attempt: int = 0  # submissions so far minus one
    failures: int = 0


@dataclasses.dataclass
class _Group:
    task: Task
    group: int
    slots: list[_Slot]
    admitted: list[tuple[Session, float]] = dataclasses.field(default_factory=list)
    state: str = "running"  # running, complete, abandoned, dropped


@dataclasses.dataclass
class _Batch:
    data: Batch
    tasks: list[Task]
    groups: list[_Group] = dataclasses.field(default_factory=list)
    submitted: bool = False


@dataclasses.dataclass
class _Admitted:
    """One process's share of a call: its packed batch (None without sessions) and what the record needs."""

    out: Batch | None
    sessions: list[Session]
    metrics: dict[str, float]
    groups: int
    cut: int
    abandoned: int
    causes: collections.Counter
    cancellations: int
    waited: float


class RolloutScheduler:
    """The Trainer's rollout over a SessionSource (see the module docstring for the rules).

    objective: a GRPOObjective (``packed_log_probs`` rescoring, ``behavior_importance``).
    source: a SessionSource; ``cancel(future)`` is used when the source has it.
    weights: what serves the source, with ``load(params, version)`` and ``version``.
    width, rows: the packed batch's shape [rows, width]; width must be ``seq_len + 1``.
    tasks: ``task_ids``, ``prompt_tasks`` or a callable batch -> list[Task] (None: by fields).
    log: a callable receiving a :class:`SchedulerRecord` per call.
    push: on a multi-process trainer, "one" (process 0 loads ``weights``, which serves
    every process's source) or "each" (every process loads its own ``weights``).
    """

    def __init__(
        self,
        objective,
        source: SessionSource,
        weights,
        *,
        width: int,
        rows: int,
        tasks: Callable[[Batch], list[Task]] | None = None,
        groups: int,
        max_lag: int = 1,
        ahead: int = 1,
        sync_every: int = 1,
        truncation: str = "mask",
        max_attempts: int = 3,
        timeout: float | None = None,
        oversample: int = 0,
        admit: int | None = None,
        support_capacity: int | None = None,
        estimator: str = "group",
        log: Callable[[SchedulerRecord], Any] | None = None,
        push: str = "one",
    ):
        if push not in PUSHES:
            raise ValueError(f"push must be one of {PUSHES}, got {push!r}")
        if not isinstance(source, SessionSource):
            raise TypeError(f"source must be a SessionSource, got {type(source).__name__}")
        if not hasattr(weights, "load") or not hasattr(weights, "version"):
            raise TypeError(f"weights must have load(params, version) and version, got {type(weights).__name__}")
        for name, value, low in (("width", width, 2), ("rows", rows, 1), ("groups", groups, 2),
                                 ("max_lag", max_lag, 0), ("ahead", ahead, 0), ("sync_every", sync_every, 1),
                                 ("max_attempts", max_attempts, 1), ("oversample", oversample, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if admit is not None and (isinstance(admit, bool) or not isinstance(admit, int) or admit < 1):
            raise ValueError(f"admit must be None or a positive integer, got {admit!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be None or a positive number of seconds, got {timeout!r}")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if max_lag < ahead + sync_every - 1:
            raise ValueError(
                f"max_lag={max_lag} is below ahead + sync_every - 1 = {ahead} + {sync_every} - 1 = "
                f"{ahead + sync_every - 1}, the staleness of a first submission; every rollout could be discarded"
            )
        if max_lag > 0 and getattr(objective, "behavior_importance", None) is None:
            raise ValueError(
                f"max_lag={max_lag} lets rollouts come from older weights than the trainer's, so the objective "
                "must correct for it: set GRPOObjective(behavior_importance=...) (a TIS cap or an IcePop band)"
            )
        seq_len = getattr(objective, "seq_len", None)
        if seq_len is not None and width != seq_len + 1:
            raise ValueError(f"width must be the objective's seq_len + 1 = {seq_len + 1}, got {width}")
        if tasks is not None and not callable(tasks):
            raise TypeError(f"tasks must be a callable batch -> list[Task], got {tasks!r}")
        self.objective, self.source, self.weights = objective, source, weights
        self.width, self.rows, self.groups = width, rows, groups
        self.max_lag, self.ahead, self.sync_every = max_lag, ahead, sync_every
        self.truncation, self.max_attempts, self.timeout = truncation, max_attempts, timeout
        self.oversample, self.admit, self.support_capacity = oversample, admit, support_capacity
        self.estimator, self.log, self.push = estimator, log, push
        self.converter = tasks or _infer_tasks
        self._rescore = jax.jit(objective.packed_log_probs)
        self._sharded_rescore: dict = {}  # mesh -> the rescoring jitted to return row-sharded scores
        self._processes = jax.process_count()
        self._agreed: int | None = None  # multi-process: the served version every process agreed on
        self._queue: collections.deque[_Batch] = collections.deque()  # registered, not yet trained on
        self._next_group = 0
        self._finished: dict[Future, float] = {}

    # ----- the stream ------------------------------------------------------------------------

    def tasks(self, dataset: Dataset) -> Dataset:
        """``dataset`` with a training stream that registers each batch with this scheduler as it is read."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"tasks needs a dew.Dataset, got {type(dataset).__name__}")

        def train(partition):
            self._reset()  # a reopened stream: what the old one left running is cancelled
            inner = iter(dataset.train(partition))
            kind = _PositionedStream if isinstance(inner, StreamPosition) else _AheadStream
            return kind(self, inner)

        return Dataset(train=train, val=dataset.val, records=dataset.records, batch=dataset.batch)

    def register(self, batch: Batch) -> None:
        """Queue a data batch that the trainer will hand over later (the stream calls this)."""
        self._queue.append(_Batch(batch, list(self.converter(batch))))

    def _reset(self) -> None:
        for entry in self._queue:
            self._cancel_batch(entry)
        self._queue.clear()

    # ----- submission ------------------------------------------------------------------------

    def _cancel(self, future: Future | None) -> bool:
        if future is None or future.done():
            return False
        cancel = getattr(self.source, "cancel", None)
        if cancel is not None:
            cancel(future)
        else:
            future.cancel()
        return True

    def _cancel_batch(self, entry: _Batch) -> int:
        return sum(self._close_group(group) for group in entry.groups)

    def _watch(self, future: Future) -> Future:
        future.add_done_callback(lambda f: self._finished.setdefault(f, time.monotonic()))
        return future

    def _submit_batch(self, entry: _Batch) -> None:
        version = self.served_version
        try:
            for task in entry.tasks:
                group = _Group(task, self._next_group, [_Slot(s) for s in range(self.groups + self.oversample)])
                self._next_group += 1
                entry.groups.append(group)
                futures = self.source.submit(task, group.group, len(group.slots))
                if len(futures) != len(group.slots):
                    raise ValueError(f"the source returned {len(futures)} futures for {len(group.slots)} samples")
                now = time.monotonic()
                for slot, future in zip(group.slots, futures):
                    slot.future, slot.submitted, slot.version = self._watch(future), now, version
        finally:
            entry.submitted = True

    def _resubmit(self, group: _Group, slot: _Slot) -> None:
        futures = self.source.submit(group.task, group.group, 1)
        if len(futures) != 1:
            raise ValueError(f"the source returned {len(futures)} futures for 1 sample")
        slot.future = self._watch(futures[0])
        slot.submitted, slot.version = time.monotonic(), self.served_version
        slot.attempt += 1

    # ----- weights ---------------------------------------------------------------------------

    @property
    def served_version(self) -> int:
        """The version serving this process's source.

        One process: ``weights.version``. Several: the version every process agreed on at
        the last push (or, before any, at the first scheduler call).
        """
        if self._processes == 1:
            return int(self.weights.version)
        if self._agreed is None:
            raise RuntimeError("the processes agree on the served version at the first scheduler call; none ran yet")
        return self._agreed

    def _loads_here(self) -> bool:
        return self.push == "each" or jax.process_index() == 0

    def _meet(self) -> None:
        """The first call on a multi-process trainer: agree on the served version and the shared options."""
        options = {"rows": self.rows, "width": self.width, "sync_every": self.sync_every, "push": self.push}
        served = int(self.weights.version) if self._loads_here() else None
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
        self._agreed = next(iter(versions.values()))

    def _push(self, variables, version: int) -> bool:
        if self._processes > 1 and self._agreed is None:
            self._meet()
        before = self.served_version
        if version - before < self.sync_every:
            return False
        if self._processes > 1:
            return self._push_together(variables, version, before)
        # The trainer donates its state to the next update; the server must keep a copy of its own.
        variables = jax.tree.map(jnp.copy, variables)
        for _ in range(2):
            self.weights.load(variables, version)
            if int(self.weights.version) == version:
                return True
        raise RuntimeError(
            f"pushing weights for version {version} left the served version at {int(self.weights.version)} "
            f"(was {before}) after two tries"
        )

    def _push_together(self, variables, version: int, before: int) -> bool:
        """Every process calls: gather to host, load where ``push`` says, agree on the outcome."""
        host = collective_host(variables)
        loads = self._loads_here()
        for attempt in range(2):
            error, served = None, None
            if loads:
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
                self._agreed = version
                return True
        where = ", ".join(f"{served} on process {p}" for p, served in stuck.items())
        raise RuntimeError(
            f"pushing weights for version {version} left the served version at {where} (was {before}) after two tries"
        )

    # ----- the rollout -----------------------------------------------------------------------

    def __call__(self, batch: Batch, variables, version: int, key=None) -> Batch | None:
        version = int(version)
        pushed = self._push(variables, version)  # every process pushes before any reads its batch
        try:
            got = self._admit(batch, version)
        except Exception as error:
            if self._processes > 1:
                everyone = exchange({"error": describe_error(error)})
                raise_failures(everyone, error, f"rollout admission for update {version}")
            raise
        out = got.out
        trainable = out is not None and bool((np.asarray(out["response_mask"]) != 0).any())
        if self._processes > 1:
            out = self._together(out if trainable else None, len(got.sessions), version)
        elif not trainable:
            out = None  # every admitted rollout masked: nothing to train on
        if out is not None:
            out["old_log_probs"] = self._proximal(variables, out)
        versions = [min(c.version for c in s.calls) for s in got.sessions if s.calls]
        oldest = min(versions) if versions else None
        record = SchedulerRecord(
            version=version, oldest_version=oldest, lag=None if oldest is None else version - oldest,
            admitted_groups=got.groups, resubmissions=dict(got.causes), cancellations=got.cancellations,
            abandoned_groups=got.abandoned, cut_groups=got.cut, waited=got.waited, pushed=pushed,
            metrics=got.metrics,
        )
        if self.log is not None:
            self.log(record)
        return out

    def _admit(self, batch: Batch, version: int) -> _Admitted:
        """Submit what is due, collect ``batch``'s groups and pack them: what one process does alone."""
        causes: collections.Counter = collections.Counter()
        stats = {"cancellations": 0}
        entry = self._take(batch)
        try:
            if not entry.submitted:
                self._submit_batch(entry)
            for later in list(self._queue)[: self.ahead]:
                if not later.submitted:
                    self._submit_batch(later)
            started = time.monotonic()
            admitted, cut = self._collect(entry, version, causes, stats)
            waited = time.monotonic() - started
        except BaseException:
            self._cancel_batch(entry)
            raise
        sessions = [s for group in admitted for s, _ in group.admitted]
        latencies = [latency for group in admitted for _, latency in group.admitted]
        out, metrics = None, {}
        if sessions:
            out = pack(sessions, self.width, rows=self.rows, estimator=self.estimator, truncation=self.truncation,
                       support_capacity=self.support_capacity)
            metrics = session_metrics(sessions, out, latencies, version=version, truncation=self.truncation)
        return _Admitted(out=out, sessions=sessions, metrics=metrics, groups=len(admitted), cut=cut,
                         abandoned=sum(g.state == "abandoned" for g in entry.groups), causes=causes,
                         cancellations=stats["cancellations"], waited=waited)

    def _together(self, out: Batch | None, sessions: int, version: int) -> Batch | None:
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
            out = pack([], self.width, rows=self.rows, estimator=self.estimator, truncation=self.truncation)
        else:
            out = dict(out)
        for name, (dtype, shape) in fields.items():
            if name not in out:
                out[name] = np.full((self.rows, *shape), _PADDING.get(name, 0), np.dtype(dtype))
        # session_index must name sessions across the global batch (the session-mean aggregation counts them).
        offset = sum(theirs["sessions"] for theirs in everyone[: jax.process_index()])
        index = np.asarray(out["session_index"])
        out["session_index"] = np.where(index >= 0, index + offset, index).astype(index.dtype)
        return out

    def _take(self, batch: Batch) -> _Batch:
        """The registered entry of ``batch``; entries before it (skipped on resume) are dropped."""
        for index, entry in enumerate(self._queue):
            if entry.data is batch:
                for _ in range(index):
                    self._cancel_batch(self._queue.popleft())
                return self._queue.popleft()
        return _Batch(batch, list(self.converter(batch)))  # not read through scheduler.tasks: nothing ahead

    def _proximal(self, variables, batch: Batch) -> np.ndarray:
        """old_log_probs of this process's rows under ``variables``: [rows, width] float32, 0 off sampled ids.

        On several processes every process calls with its own rows: one computation over
        the global batch, on the mesh the variables live on.
        """
        fields = {k: np.asarray(batch[k]) for k in _RESCORED if k in batch}
        if self._processes == 1:
            scores = np.asarray(self._rescore(variables, {k: jnp.asarray(v) for k, v in fields.items()}))
        else:
            mesh = _mesh_of(variables)
            if mesh not in self._sharded_rescore:
                self._sharded_rescore[mesh] = jax.jit(self.objective.packed_log_probs,
                                                      out_shardings=row_sharded(mesh))
            scores = process_rows(self._sharded_rescore[mesh](variables, shard_batch(fields, mesh)))
        return np.where(np.asarray(batch["response_mask"]) != 0, scores, 0.0).astype(np.float32)

    def _collect(self, entry: _Batch, version: int, causes, stats) -> tuple[list[_Group], int]:
        """Wait until every group of the batch is admitted, cut, abandoned or dropped."""
        admitted: list[_Group] = []
        lengths: list[int] = []
        cut = 0

        def fail(group: _Group, slot: _Slot, cause: str, failed: bool) -> None:
            if failed:
                slot.failures += 1
                if slot.failures >= self.max_attempts:
                    group.state = "abandoned"
                    slot.future = None
                    stats["cancellations"] += self._close_group(group)
                    return
            causes[cause] += 1
            self._resubmit(group, slot)

        # Rollouts still running that went out more than max_lag updates ago: cancel, resubmit.
        for group in entry.groups:
            for slot in group.slots:
                if slot.future is not None and not slot.future.done() and version - slot.version > self.max_lag:
                    stats["cancellations"] += self._cancel(slot.future)
                    fail(group, slot, "stale_running", failed=False)

        while True:
            running = [g for g in entry.groups if g.state == "running"]
            if not running:
                break
            pending = {s.future: (g, s) for g in running for s in g.slots if s.future is not None}
            if not pending:  # cannot happen: a running group always has a live sample or is complete
                raise AssertionError("a running group has no live samples")
            done = [f for f in pending if f.done()]
            if not done:
                wait_for = None
                if self.timeout is not None:
                    nearest = min(s.submitted for _, s in pending.values()) + self.timeout
                    wait_for = max(0.0, min(_POLL, nearest - time.monotonic()))
                done = list(wait(list(pending), timeout=wait_for, return_when=FIRST_COMPLETED).done)
            for future in done:
                group, slot = pending[future]
                if group.state != "running" or slot.future is not future:
                    continue
                slot.future = None
                session = future.result()  # a source that raised: propagates, the caller cancels the batch
                finished = self._finished.pop(future, time.monotonic())
                status = session.status
                if status in (Status.INFRA_ERROR, Status.CANCELLED):
                    fail(group, slot, status.name.lower(), failed=True)
                    continue
                if session.calls and version - min(c.version for c in session.calls) > self.max_lag:
                    fail(group, slot, "stale", failed=False)
                    continue
                if status is Status.TRUNCATED and self.truncation == "score" and session.reward is None:
                    fail(group, slot, "unscored_truncation", failed=True)
                    continue
                session = dataclasses.replace(session, task=group.task, group=group.group, sample=slot.sample,
                                              attempt=slot.attempt)
                group.admitted.append((session, finished - slot.submitted))
                if len(group.admitted) < self.groups:
                    continue
                group.state = "complete"
                stats["cancellations"] += self._close_group(group)  # oversampled extras
                own = chain_lengths([s for s, _ in group.admitted], self.width, self.truncation)
                if rows_needed(own, self.width) > self.rows:
                    raise ValueError(
                        f"group {group.group} (task {group.task.id!r}) packs into {rows_needed(own, self.width)} rows "
                        f"of width {self.width} on its own; rows={self.rows} cannot hold it"
                    )
                if rows_needed(lengths + own, self.width) > self.rows:
                    cut += 1
                    continue
                lengths += own
                admitted.append(group)
                if self.admit is not None and len(admitted) >= self.admit:
                    for other in entry.groups:
                        if other.state == "running":
                            other.state = "dropped"
                            stats["cancellations"] += self._close_group(other)
                    break
            if self.timeout is not None:
                now = time.monotonic()
                for group in entry.groups:
                    for slot in group.slots:
                        if (group.state == "running" and slot.future is not None and not slot.future.done()
                                and now - slot.submitted >= self.timeout):
                            stats["cancellations"] += self._cancel(slot.future)
                            slot.future = None
                            fail(group, slot, "timeout", failed=True)
        return admitted, cut

    def _close_group(self, group: _Group) -> int:
        count = 0
        for slot in group.slots:
            count += self._cancel(slot.future)
            slot.future = None
        return count

    def close(self) -> None:
        """Cancel every rollout in flight and forget the registered batches."""
        self._reset()


# ----- meeting the other processes -------------------------------------------------------------

_RESCORED = ("input_ids", "text_segment_ids", "text_positions", "support_ids", "support_columns")
_PADDING = {"support_ids": -1, "support_columns": -1}  # pack's fill for the fields it adds only with supports
def _mesh_of(variables):
    """The trainer's data mesh, read from the variables' sharding (default: every device)."""
    for leaf in jax.tree.leaves(variables):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and DATA_AXIS in sharding.mesh.axis_names:
            return sharding.mesh
    return data_mesh()


# ----- the stream wrappers ---------------------------------------------------------------------


class _AheadStream:
    """Reads up to ``ahead`` batches beyond the one it hands over, registering each as it reads it."""

    def __init__(self, scheduler: RolloutScheduler, inner: Iterator[Batch]):
        self._scheduler, self._inner = scheduler, inner
        self._buffer: collections.deque = collections.deque()  # (position before the batch, batch)
        self._ended = False

    def __iter__(self):
        return self

    def _where(self) -> Any:
        return None

    def _fill(self) -> None:
        while not self._ended and len(self._buffer) < self._scheduler.ahead + 1:
            where = self._where()
            try:
                batch = next(self._inner)
            except StopIteration:
                self._ended = True
                return
            self._scheduler.register(batch)
            self._buffer.append((where, batch))

    def __next__(self) -> Batch:
        self._fill()
        if not self._buffer:
            raise StopIteration
        return self._buffer.popleft()[1]


class _PositionedStream(_AheadStream):
    """An ahead stream over a stream with positions: reports the next batch it hands over."""

    def _where(self) -> Any:
        return self._inner.position()

    def position(self) -> Any:
        return self._buffer[0][0] if self._buffer else self._inner.position()

    def restore(self, position: Any) -> None:
        self._inner.restore(position)
        self._buffer.clear()
        self._ended = False
        self._scheduler._reset()
