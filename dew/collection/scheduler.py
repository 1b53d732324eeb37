"""RolloutScheduler: the Trainer's rollout for any SessionSource, with batches in flight ahead.

``RolloutScheduler(objective, source, weights, width=W, rows=N, groups=G, ...)`` is a
:class:`~dew.trainer.Rollout`. Train on ``scheduler.tasks(dataset)`` with
``Trainer(..., rollout=scheduler)``: each task of a data batch becomes one group of G
rollouts, and the scheduler returns the group-relative ``[N, W]`` GRPO batch.

Reading ahead (:mod:`dew.collection.streams`): when the trainer passes batch i to the
scheduler, batches i + 1 .. i + ahead, which the wrapped stream already read and
registered, are submitted under the version the weights serve at that moment. The
checkpointed data position stays the trainer's; reopening the stream cancels what the old
one left in flight, and a resumed run resubmits the batches it re-reads.

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

``deterministic=True`` takes the timing out of what is trained, for a source whose draws
depend only on their seeds and weights (a native ``Server(batch_invariant=True)``): a weight
push first waits for every draw submitted under the weights it replaces, so each draw runs
under the version it was submitted at; and a batch's rollouts are taken in submission order
(group, then sample) once all of them have finished, so which are admitted, cut or drawn
again does not depend on which finished first. A run with failures (a dead server's draws)
is drawn again under whatever is served then, and stays as timing makes it.

``oversample=K`` submits G + K samples per group and admits the first G to finish;
``admit=M`` admits the first M groups of a batch to complete and cancels the rest. A
complete group is admitted only if its chains fit N rows beside the groups admitted
before it (otherwise it is *cut*); a group that cannot fit N rows on its own raises.
``old_log_probs`` is rescored under the trainer's current variables (the proximal
policy), unless the objective takes the trained policy itself as the proximal one
(``GRPOObjective(proximal="current")``: the same numbers without that forward pass);
``behavior_log_probs`` stays as the engine reported it; ``lags`` says how many
updates behind the trained weights each sampled id's weights were (GRPOObjective's
``max_token_lag`` reads it).

Multi-process trainers. Every trainer process runs its own scheduler, on its own source,
over the task rows its partition of the data stream reads, and packs its own N rows; the
step's batch is every process's rows together (the Trainer shards the returned rows as
it shards any batch), so no rollout crosses a process. The calls meet at the weight push
(``push="one"``: process 0 loads ``weights``, which serves every process's source;
``push="each"``: every process loads its own), the admission and the proximal rescoring:
:mod:`dew.collection.agreement` says how. Construction makes no collective call; a
source that never resolves still blocks every process (use ``timeout``). Each process
logs its own :class:`SchedulerRecord`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.collection.agreement import RESCORED, ProcessAgreement
from dew.collection.bookkeeping import Admitted, BatchEntry, GroupEntry, SchedulerRecord, Slot
from dew.collection.streams import AheadStream, PositionedStream
from dew.collection.tasks import infer_tasks
from dew.data.dataset import Batch, Dataset, StreamPosition
from dew.inference.publisher import WeightPublisher
from dew.losses.advantages import ESTIMATORS
from dew.models.packed_attention import SharedPromptRows
from dew.records.session_metrics import session_metrics
from dew.records.session_packing import chain_lengths, fitted_layout, pack, rows_needed
from dew.records.session_records import TRUNCATIONS, SessionSource, Status, Task
from dew.validation import integer, one_of, positive, positive_int

logger = logging.getLogger(__name__)

_POLL = 0.05  # seconds between checks of timeouts while waiting on rollouts
PUSHES = ("one", "each")


def token_lags(versions, version: int) -> np.ndarray:
    """[rows, width] int32: how many updates each sampled id's weights are behind ``version`` (0 elsewhere)."""
    versions = np.asarray(versions)
    return np.where(versions >= 0, version - versions, 0).astype(np.int32)


class RolloutScheduler:
    """The Trainer's rollout over a SessionSource (see the module docstring for the rules).

    objective: a GRPOObjective (``packed_log_probs`` rescoring, ``behavior_importance``).
    source: a SessionSource; ``cancel(future)`` is used when the source has it.
    weights: what serves the source, with ``load(params, version)`` and ``version``.
    width, rows: the packed batch's shape [rows, width]; width must be ``seq_len + 1``.
    tasks: ``task_ids``, ``prompt_tasks`` or a callable batch -> list[Task] (None: by fields).
    log: a callable receiving a :class:`SchedulerRecord` per call.
    deterministic: draws under the version submitted at, admission in submission order (see the module docstring).
    layout: a :class:`~dew.models.packed_attention.SharedPromptRows`: pack each group's prompt once for its samples
    (``pack(..., layout=...)``), a row per group; ``width`` must be the layout's and ``rows`` the groups of a batch.
    On one process a batch's rows have only the slots its responses fill (``fitted_layout``: fewer and shorter
    slots, short responses sharing one, so fewer ids to train on); several processes keep the layout's, as their
    rows must agree.
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
        deterministic: bool = False,
        layout: SharedPromptRows | None = None,
    ):
        one_of("push", push, PUSHES)
        if not isinstance(source, SessionSource):
            raise TypeError(f"source must be a SessionSource, got {type(source).__name__}")
        if not isinstance(weights, WeightPublisher):
            raise TypeError(f"weights must be a dew.inference.WeightPublisher (load(variables, version) and version), "
                            f"got {type(weights).__name__}")
        for name, value, low in (("width", width, 2), ("rows", rows, 1), ("groups", groups, 2),
                                 ("max_lag", max_lag, 0), ("ahead", ahead, 0), ("sync_every", sync_every, 1),
                                 ("max_attempts", max_attempts, 1), ("oversample", oversample, 0)):
            integer(name, value, at_least=low)
        if admit is not None:
            positive_int("admit", admit, why="or None")
        if timeout is not None:
            positive("timeout", timeout, why="seconds, or None")
        one_of("truncation", truncation, TRUNCATIONS)
        one_of("estimator", estimator, ESTIMATORS)
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
        self.deterministic = bool(deterministic)
        if layout is not None and width != layout.width:
            raise ValueError(f"width must be the shared-prompt layout's width {layout.width}, got {width}")
        self.layout = layout
        self.converter = tasks or infer_tasks
        self._rescore = jax.jit(objective.packed_log_probs)
        options = {"rows": rows, "width": width, "sync_every": sync_every, "push": push}
        self._agreement = ProcessAgreement(weights, push, options) if jax.process_count() > 1 else None
        self._queue: collections.deque[BatchEntry] = collections.deque()  # registered, not yet trained on
        self.next_group = 0  # the first group id of the next batch registered (the streams checkpoint it)
        self._finished: dict[Future, float] = {}

    # ----- the stream ------------------------------------------------------------------------

    def tasks(self, dataset: Dataset) -> Dataset:
        """``dataset`` with a training stream that registers each batch with this scheduler as it is read."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"tasks needs a dew.Dataset, got {type(dataset).__name__}")

        def train(partition):
            self.reset()  # a reopened stream: what the old one left running is cancelled
            inner = iter(dataset.train(partition))
            kind = PositionedStream if isinstance(inner, StreamPosition) else AheadStream
            return kind(self, inner)

        return Dataset(train=train, val=dataset.val, records=dataset.records, batch=dataset.batch)

    def register(self, batch: Batch) -> None:
        """Queue a data batch that the trainer will hand over later (the stream calls this)."""
        self._queue.append(self._entry(batch))

    def _entry(self, batch: Batch) -> BatchEntry:
        """A batch and its tasks, its groups numbered after every batch read before it: a group's id (and so its
        samples' seeds) depends on where the batch stands in the stream, not on when it was submitted."""
        tasks = list(self.converter(batch))
        entry = BatchEntry(batch, tasks, self.next_group)
        self.next_group += len(tasks)
        return entry

    def reset(self) -> None:
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

    def _cancel_batch(self, entry: BatchEntry) -> int:
        return sum(self._close_group(group) for group in entry.groups)

    def _watch(self, future: Future) -> Future:
        future.add_done_callback(lambda f: self._finished.setdefault(f, time.monotonic()))
        return future

    def _submit_batch(self, entry: BatchEntry) -> None:
        version = self.served_version
        try:
            for number, task in enumerate(entry.tasks, start=entry.first_group):
                group = GroupEntry(task, number, [Slot(s) for s in range(self.groups + self.oversample)])
                entry.groups.append(group)
                futures = self.source.submit(task, group.group, len(group.slots))
                if len(futures) != len(group.slots):
                    raise ValueError(f"the source returned {len(futures)} futures for {len(group.slots)} samples")
                now = time.monotonic()
                for slot, future in zip(group.slots, futures):
                    slot.future, slot.submitted, slot.version = self._watch(future), now, version
        finally:
            entry.submitted = True

    def _resubmit(self, group: GroupEntry, slot: Slot) -> None:
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
        if self._agreement is None:
            return int(self.weights.version)
        if self._agreement.agreed is None:
            raise RuntimeError("the processes agree on the served version at the first scheduler call; none ran yet")
        return self._agreement.agreed

    def _push(self, variables, version: int) -> bool:
        if self._agreement is not None and self._agreement.agreed is None:
            self._agreement.meet()
        before = self.served_version
        if version - before < self.sync_every:
            return False
        if self.deterministic:  # every draw runs under the weights it was submitted under
            wait([slot.future for entry in self._queue if entry.submitted for group in entry.groups
                  for slot in group.slots if slot.future is not None])
        if self._agreement is not None:
            return self._agreement.push_weights(variables, version, before)
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

    # ----- the rollout -----------------------------------------------------------------------

    def __call__(self, batch: Batch, variables, version: int, key=None) -> Batch | None:
        version = int(version)
        began = time.perf_counter()
        pushed = self._push(variables, version)  # every process pushes before any reads its batch
        push_seconds = time.perf_counter() - began
        try:
            got = self._admit(batch, version)
        except Exception as error:
            if self._agreement is not None:
                self._agreement.failed(error, version)
            raise
        out = got.out
        trainable = out is not None and bool((np.asarray(out["response_mask"]) != 0).any())
        if self._agreement is not None:
            out = self._agreement.together(out if trainable else None, len(got.sessions), version, width=self.width,
                                           rows=self.rows, estimator=self.estimator, truncation=self.truncation)
        elif not trainable:
            out = None  # every admitted rollout masked: nothing to train on
        if out is not None:
            if getattr(self.objective, "proximal", "batch") == "batch":
                out["old_log_probs"] = self._proximal(variables, out)
            else:  # the objective scores the trained policy itself as the proximal one
                out.pop("old_log_probs", None)
            out["lags"] = token_lags(out["versions"], version)
        versions = [min(c.version for c in s.calls) for s in got.sessions if s.calls]
        oldest = min(versions) if versions else None
        record = SchedulerRecord(
            version=version, oldest_version=oldest, lag=None if oldest is None else version - oldest,
            admitted_groups=got.groups, resubmissions=dict(got.causes), cancellations=got.cancellations,
            abandoned_groups=got.abandoned, cut_groups=got.cut, waited=got.waited, pushed=pushed,
            metrics=got.metrics, sessions=list(got.sessions), push_seconds=push_seconds,
        )
        if self.log is not None:
            self.log(record)
        return out

    def _admit(self, batch: Batch, version: int) -> Admitted:
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
        # Packed in (group, sample) order, not in the order rollouts finished: the same admitted sessions always
        # make the same batch, so a resumed run trains what an uninterrupted one would.
        ordered = [item for group in sorted(admitted, key=lambda g: g.group)
                   for item in sorted(group.admitted, key=lambda item: item[0].sample)]
        sessions = [s for s, _ in ordered]
        latencies = [latency for _, latency in ordered]
        out, metrics = None, {}
        if sessions:
            layout, width = self.layout, self.width
            if layout is not None and self._agreement is None:
                layout = fitted_layout(sessions, layout, self.truncation)
                width = layout.width
            out = pack(sessions, width, rows=self.rows, estimator=self.estimator, truncation=self.truncation,
                       support_capacity=self.support_capacity, layout=layout)
            metrics = session_metrics(sessions, out, latencies, version=version, truncation=self.truncation)
        return Admitted(out=out, sessions=sessions, metrics=metrics, groups=len(admitted), cut=cut,
                         abandoned=sum(g.state == "abandoned" for g in entry.groups), causes=causes,
                         cancellations=stats["cancellations"], waited=waited)

    def _take(self, batch: Batch) -> BatchEntry:
        """The registered entry of ``batch``; entries before it (skipped on resume) are dropped."""
        for index, entry in enumerate(self._queue):
            if entry.data is batch:
                for _ in range(index):
                    self._cancel_batch(self._queue.popleft())
                return self._queue.popleft()
        return self._entry(batch)  # not read through scheduler.tasks: nothing ahead

    def _proximal(self, variables, batch: Batch) -> np.ndarray:
        """old_log_probs of this process's rows under ``variables``: [rows, width] float32, 0 off sampled ids.

        On several processes every process calls with its own rows: one computation over
        the global batch, on the mesh the variables live on.
        """
        fields = {k: np.asarray(batch[k]) for k in RESCORED if k in batch}
        if self._agreement is None:
            scores = np.asarray(self._rescore(variables, {k: jnp.asarray(v) for k, v in fields.items()}))
        else:
            scores = self._agreement.rescore(self.objective.packed_log_probs, variables, fields)
        return np.where(np.asarray(batch["response_mask"]) != 0, scores, 0.0).astype(np.float32)

    def _collect(self, entry: BatchEntry, version: int, causes, stats) -> tuple[list[GroupEntry], int]:
        """Wait until every group of the batch is admitted, cut, abandoned or dropped."""
        admitted: list[GroupEntry] = []
        lengths: list[int] = []
        cut = 0

        def fail(group: GroupEntry, slot: Slot, cause: str, failed: bool) -> None:
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
            if len(done) < len(pending) if self.deterministic else not done:
                wait_for = None
                if self.timeout is not None:
                    nearest = min(s.submitted for _, s in pending.values()) + self.timeout
                    wait_for = max(0.0, min(_POLL, nearest - time.monotonic()))
                done = list(wait(list(pending), timeout=wait_for,
                                 return_when=ALL_COMPLETED if self.deterministic else FIRST_COMPLETED).done)
            if self.deterministic:  # in submission order, once every one is in (the timeouts below may come first)
                done = sorted(done, key=lambda f: (pending[f][0].group, pending[f][1].sample))
                done = done if len(done) == len(pending) else []
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
                own = chain_lengths([s for s, _ in group.admitted], self.width, self.truncation, self.layout)
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

    def _close_group(self, group: GroupEntry) -> int:
        count = 0
        for slot in group.slots:
            count += self._cancel(slot.future)
            slot.future = None
        return count

    def close(self) -> None:
        """Cancel every rollout in flight and forget the registered batches."""
        self.reset()
