"""What the RolloutScheduler keeps while rollouts run, and the record it logs for each call.

A registered data batch is a :class:`BatchEntry` of :class:`GroupEntry` s (one per task),
each with a :class:`Slot` per sample: its live future, when and under which version it
went out, its attempts and failures. :class:`Admitted` is one process's share of a call
before the processes meet; :class:`SchedulerRecord` is what ``log`` receives.
"""

from __future__ import annotations

import collections
import dataclasses
from concurrent.futures import Future

from dew.data.dataset import Batch
from dew.records.session_records import Session, Task


@dataclasses.dataclass
class SchedulerRecord:
    """What one scheduler call did (see the module docstring).

    version: the trainer's version; oldest_version and lag: of the oldest call among
    admitted rollouts (None without any); resubmissions: count by cause ("infra_error",
    "cancelled", "unscored_truncation", "stale", "stale_running", "timeout");
    cancellations: futures cancelled (timeouts, staleness, oversample extras, admit,
    abandonment); waited: seconds spent waiting on rollouts; pushed: whether this call
    pushed weights; push_seconds: how long the push took (0 without one); metrics: ``session_metrics`` over the admitted rollouts and their batch;
    sessions: the admitted rollouts themselves, in the order they were packed (to keep
    them, as ``dew.records.verl_rows.to_verl`` rows say).
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
    sessions: list[Session] = dataclasses.field(default_factory=list)
    push_seconds: float = 0.0


@dataclasses.dataclass
class Slot:
    """One sample of a group: its live future, when and under which version it went out, its failures."""

    sample: int
    future: Future | None = None
    submitted: float = 0.0
    version: int = 0
    attempt: int = 0  # submissions so far minus one
    failures: int = 0


@dataclasses.dataclass
class GroupEntry:
    task: Task
    group: int
    slots: list[Slot]
    admitted: list[tuple[Session, float]] = dataclasses.field(default_factory=list)
    state: str = "running"  # running, complete, abandoned, dropped


@dataclasses.dataclass
class BatchEntry:
    """A data batch the scheduler will train on; its groups are numbered from ``first_group`` in task order."""

    data: Batch
    tasks: list[Task]
    first_group: int
    groups: list[GroupEntry] = dataclasses.field(default_factory=list)
    submitted: bool = False


@dataclasses.dataclass
class Admitted:
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
