"""Engine-sourced rollouts as records: Call, Session, Status, Task and the SessionSource protocol.

A :class:`Call` is one engine request: the ``prompt_ids`` the engine read, the
``sampled_ids`` it drew (EOS included on a natural stop), one behaviour log-probability
per sampled id, why it finished and the policy version served when it was submitted.
Optional: the raw-policy log-probabilities (``old_log_probs``) when the engine reports
them, ``routed_experts`` (a mixture-of-experts router record, one row per id the engine
read or drew, from the chain's start) and ``support`` (the ids the sampler kept for
each sampled id). Every Call that reaches ``pack`` is checked by
:func:`dew.records.actions.check_call`, the validator live, imported and restored
actions share.

A :class:`Session` is one harness session: task, group, sample, attempt, its calls in
submission order, a :class:`Status`, the verifier's reward with its components, a
detail string and, for a multi-turn episode, ``episode_metrics`` (turns, truncation and
what the environment reports about itself, such as tool calls and tool errors). A :class:`SessionSource` turns a :class:`Task` into futures of sessions.
:func:`training_reward` says which sessions train, on what reward.

:mod:`dew.records.session_packing` turns sessions into one training batch and
:mod:`dew.records.session_metrics` reports on it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from dew.losses.advantages import ESTIMATORS

TRUNCATIONS = ("mask", "score", "zero")
class Status(enum.Enum):
    """How a session ended."""

    COMPLETED = "completed"  # the harness finished and the verifier scored it
    TRUNCATED = "truncated"  # a context, turn, budget or wall-clock limit cut it off
    AGENT_ERROR = "agent_error"  # the policy's own failure (bad tool call, malformed answer): trains on its reward
    INFRA_ERROR = "infra_error"  # the infrastructure failed: never trains
    CANCELLED = "cancelled"  # stopped by the scheduler: never trains


@dataclasses.dataclass(frozen=True)
class Task:
    """A unit of work: an id (advantages group by it) and whatever data the harness needs."""

    id: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Call:
    """One engine request of a session (see the module docstring)."""

    prompt_ids: Sequence[int]
    sampled_ids: Sequence[int]
    behavior_log_probs: Sequence[float]
    finish_reason: str
    version: int
    old_log_probs: Sequence[float] | None = None
    routed_experts: np.ndarray | None = None  # [ids covered, layers, top_k], from the chain's first id
    support: Sequence[Sequence[int]] | None = None  # per sampled id, the kept ids (-1 entries ignored)


@dataclasses.dataclass
class Session:
    """One harness session and its outcome."""

    task: Task
    group: int
    sample: int
    attempt: int
    calls: list[Call]
    status: Status
    reward: float | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""
    episode_metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        """What advantages are relative within: (task id, group)."""
        return (self.task.id, self.group)

    def describe(self) -> str:
        return f"session (task {self.task.id!r}, group {self.group}, sample {self.sample}, attempt {self.attempt})"


class SessionSource(abc.ABC):
    """Turns a task into futures of finished sessions (a harness, a gateway, a rollout server)."""

    @abc.abstractmethod
    def submit(self, task: Task, group: int, samples: int) -> list[Future]:
        """Start ``samples`` sessions of ``task`` in ``group``; each future resolves to a :class:`Session`."""


# ----- which sessions train, on what reward ---------------------------------------------------


def check_options(estimator: str, truncation: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    check_truncation(truncation)


def check_truncation(truncation: str) -> None:
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")


def training_reward(session: Session, truncation: str) -> float | None:
    """The reward a session trains on, or None when it takes no rows and no part in the baseline."""
    if not isinstance(session, Session):
        raise TypeError(f"pack takes Session records, got {type(session).__name__}")
    status = session.status
    if not isinstance(status, Status):
        raise TypeError(f"{session.describe()}: status must be a Status, got {status!r}")
    if status in (Status.INFRA_ERROR, Status.CANCELLED):
        return None
    if status is Status.TRUNCATED:
        if truncation == "mask":
            return None
        if truncation == "zero":
            return 0.0
    reward = session.reward
    if reward is None or isinstance(reward, bool) or not isinstance(reward, (int, float, np.number)):
        raise ValueError(f"{session.describe()} is {status.name} but its reward is {reward!r}; a number is needed")
    if not math.isfinite(reward):
        raise ValueError(f"{session.describe()} has a non-finite reward {reward!r}")
    return float(reward)
