"""Engine-sourced rollouts as records, and ``pack``, which turns them into one training batch.

A :class:`Call` is one engine request: the ``prompt_ids`` the engine read, the
``sampled_ids`` it drew (EOS included on a natural stop), one behaviour log-probability
per sampled id, why it finished and the policy version served when it was submitted.
Optional: the raw-policy log-probabilities (``old_log_probs``) when the engine reports
them, ``routed_experts`` (a mixture-of-experts router record, one row per id the engine
read or drew, from the chain's start) and ``support`` (the ids the sampler kept for
each sampled id).

A :class:`Session` is one harness session: task, group, sample, attempt, its calls in
submission order, a :class:`Status`, the verifier's reward with its components, and a
detail string. A :class:`SessionSource` turns a :class:`Task` into futures of sessions.

``pack(sessions, width, rows=None, estimator="group", truncation="mask")`` builds the
batch (see its docstring); ``chain_lengths`` and ``rows_needed`` size it beforehand and
``session_metrics`` reports on it.
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

ESTIMATORS = ("group", "mean", "rloo")
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


def _check_options(estimator: str, truncation: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    _check_truncation(truncation)


def _check_truncation(truncation: str) -> None:
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


# ----- chains ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Chain:
    session: int
    ids: list = dataclasses.field(default_factory=list)
    response: list = dataclasses.field(default_factory=list)
    behavior: list = dataclasses.field(default_factory=list)
    old: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)
    routed: list = dataclasses.field(default_factory=list)  # (call, record) in call order
    support: list = dataclasses.field(default_factory=list)  # (chain position, kept ids)
    has_old: bool = True

    def __len__(self) -> int:
        return len(self.ids)


def _check_call(session: Session, index: int, call: Call) -> None:
    where = f"{session.describe()}, call {index}"
    if not isinstance(call, Call):
        raise TypeError(f"{where}: expected a Call, got {type(call).__name__}")
    if len(call.prompt_ids) == 0:
        raise ValueError(f"{where}: prompt_ids is empty; a call reads at least one id")
    sampled = len(call.sampled_ids)
    if len(call.behavior_log_probs) != sampled:
        raise ValueError(
            f"{where}: {len(call.behavior_log_probs)} behavior_log_probs for {sampled} sampled ids; "
            "the engine must report one per sampled id"
        )
    behavior = np.asarray(call.behavior_log_probs, np.float64)
    if sampled and (not np.isfinite(behavior).all() or (behavior > 1e-6).any()):
        raise ValueError(f"{where}: behavior_log_probs must be finite log-probabilities (<= 0), got {behavior.tolist()}")
    if call.old_log_probs is not None and len(call.old_log_probs) != sampled:
        raise ValueError(f"{where}: {len(call.old_log_probs)} old_log_probs for {sampled} sampled ids")
    if call.support is not None and len(call.support) != sampled:
        raise ValueError(f"{where}: {len(call.support)} support entries for {sampled} sampled ids")
    if call.routed_experts is not None:
        record = np.asarray(call.routed_experts)
        if record.ndim != 3 or record.shape[0] > len(call.prompt_ids) + sampled:
            raise ValueError(
                f"{where}: routed_experts must be [ids covered <= {len(call.prompt_ids) + sampled}, layers, top_k], "
                f"got shape {record.shape}"
            )


def _chains(session: Session, number: int) -> list[_Chain]:
    """The session's calls as chains: call k + 1 joins when its prompt starts with the whole chain."""
    chains: list[_Chain] = []
    chain = None
    for index, call in enumerate(session.calls):
        _check_call(session, index, call)
        prompt = [int(i) for i in call.prompt_ids]
        if chain is not None and len(prompt) >= len(chain) and prompt[: len(chain)] == chain.ids:
            new = prompt[len(chain):]
        else:
            chain = _Chain(number)
            chains.append(chain)
            new = prompt
        chain.ids += new
        chain.response += [0] * len(new)
        chain.behavior += [0.0] * len(new)
        chain.old += [0.0] * len(new)
        chain.versions += [-1] * len(new)
        chain.calls += [-1] * len(new)
        sampled = [int(i) for i in call.sampled_ids]
        position = len(chain)
        chain.ids += sampled
        chain.response += [1] * len(sampled)
        chain.behavior += [float(x) for x in call.behavior_log_probs]
        if call.old_log_probs is None:
            chain.has_old = False
            chain.old += [0.0] * len(sampled)
        else:
            chain.old += [float(x) for x in call.old_log_probs]
        chain.versions += [int(call.version)] * len(sampled)
        chain.calls += [index] * len(sampled)
        if call.routed_experts is not None:
            chain.routed.append(np.asarray(call.routed_experts))
        if call.support is not None:
            for offset, kept in enumerate(call.support):
                chain.support.append((position + offset, [int(i) for i in kept if int(i) >= 0]))
    return [c for c in chains if any(c.response)]


def _trained(sessions: Sequence[Session], truncation: str) -> list[tuple[int, Session, float]]:
    trained = []
    for number, session in enumerate(sessions):
        reward = training_reward(session, truncation)
        if reward is not None:
            trained.append((number, session, reward))
    return trained


def chain_lengths(sessions: Sequence[Session], width: int, truncation: str = "mask") -> list[int]:
    """The length of every chain ``pack`` would place, in order; raises if one exceeds ``width``."""
    _check_truncation(truncation)
    lengths = []
    for number, session, _ in _trained(sessions, truncation):
        for chain in _chains(session, number):
            if len(chain) > width:
                raise ValueError(
                    f"{session.describe()} has a chain of {len(chain)} ids, longer than the row width {width}"
                )
            lengths.append(len(chain))
    return lengths


def _first_fit(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """(row, offset) of each length, each placed in the first row with room."""
    free: list[int] = []
    places = []
    for length in lengths:
        for row, room in enumerate(free):
            if room >= length:
                places.append((row, width - room))
                free[row] -= length
                break
        else:
            places.append((len(free), 0))
            free.append(width - length)
    return places


def rows_needed(lengths: Sequence[int], width: int) -> int:
    """How many rows first-fit packing of ``lengths`` into rows of ``width`` fills."""
    places = _first_fit(lengths, width)
    return 1 + max((row for row, _ in places), default=-1)


# ----- advantages -----------------------------------------------------------------------------


def session_advantages(rewards: Sequence[float], keys: Sequence[Any], estimator: str) -> np.ndarray:
    """Group-relative advantages of trained sessions, grouped by key (verl's outcome estimators)."""
    from dew.objectives.rl.losses import group_advantages

    if not rewards:
        return np.zeros(0, np.float32)
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    groups = np.array([index[key] for key in keys], np.int32)
    return np.asarray(group_advantages(np.asarray(rewards, np.float32), groups, estimator), np.float32)


# ----- pack -----------------------------------------------------------------------------------


def pack(
    sessions: Sequence[Session],
    width: int,
    rows: int | None = None,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
) -> dict[str, np.ndarray]:
    """Pack sessions into one ``[rows, width]`` training batch.

    COMPLETED and AGENT_ERROR sessions train on their reward; INFRA_ERROR and CANCELLED
    ones take no rows and no part in the baseline; ``truncation`` decides TRUNCATED ones
    ("mask": like an infrastructure failure, "score": on their reward, "zero": on
    reward 0). Advantages are group-relative over (task, group) with ``estimator``.

    Each session's calls become chains (call k + 1 joins call k's chain only when its
    prompt starts with every id of the chain so far, sampled ids included); chains are
    placed first-fit, in order. ``rows=None`` uses as many rows as needed; a given
    ``rows`` that is too few raises. Columns, all aligned with ``input_ids``:

    - ``input_ids``, ``text_segment_ids`` (1, 2, ... per chain in its row, 0 padding),
      ``text_positions`` (position within the chain): int32;
    - ``response_mask``: 1 on sampled ids (EOS included), int32;
    - ``behavior_log_probs``, and ``old_log_probs`` when every call recorded raw
      log-probabilities: float32, 0 off sampled ids;
    - ``versions``, ``session_index`` (the session's position in ``sessions``),
      ``call_index``: int32 on sampled ids, -1 elsewhere;
    - ``advantages``: the session's advantage across its whole chain, float32;
    - ``session_weights``: 1 / (the session's sampled ids) on its sampled ids, so a
      session mean is ``sum(loss * session_weights) / sessions``;
    - with router records: ``routed_experts`` [rows, width, layers, top_k] in the
      records' dtype and ``routed`` (bool, where a record covers the id);
    - with supports: ``support_ids`` and ``support_columns`` [rows, support_capacity],
      each row's kept ids back to back tagged with their sampled id's column, -1 padding.
    """
    _check_options(estimator, truncation)
    if isinstance(width, bool) or not isinstance(width, int) or width < 2:
        raise ValueError(f"width must be an integer >= 2, got {width!r}")
    trained = _trained(sessions, truncation)
    advantages = session_advantages([r for _, _, r in trained], [s.key for _, s, _ in trained], estimator)
    chains, chain_advantage = [], []
    for (number, session, _), advantage in zip(trained, advantages, strict=True):
        for chain in _chains(session, number):
            if len(chain) > width:
                raise ValueError(
                    f"{session.describe()} has a chain of {len(chain)} ids, longer than the row width {width}"
                )
            chains.append(chain)
            chain_advantage.append(float(advantage))
    places = _first_fit([len(c) for c in chains], width)
    needed = 1 + max((row for row, _ in places), default=-1)
    if rows is None:
        rows = max(needed, 1)
    elif isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be None or a positive integer, got {rows!r}")
    elif needed > rows:
        raise ValueError(f"the {len(chains)} chains need {needed} rows of width {width}; rows={rows} is too few")

    shape = (rows, width)
    batch = {
        "input_ids": np.zeros(shape, np.int32),
        "text_segment_ids": np.zeros(shape, np.int32),
        "text_positions": np.zeros(shape, np.int32),
        "response_mask": np.zeros(shape, np.int32),
        "behavior_log_probs": np.zeros(shape, np.float32),
        "versions": np.full(shape, -1, np.int32),
        "session_index": np.full(shape, -1, np.int32),
        "call_index": np.full(shape, -1, np.int32),
        "advantages": np.zeros(shape, np.float32),
        "session_weights": np.zeros(shape, np.float32),
    }
    if chains and all(c.has_old for c in chains):
        batch["old_log_probs"] = np.zeros(shape, np.float32)
    sampled_per_session: dict[int, int] = {}
    for chain in chains:
        sampled_per_session[chain.session] = sampled_per_session.get(chain.session, 0) + sum(chain.response)
    segments_in_row = [0] * rows
    routed = [(c, r) for c in chains for r in c.routed]
    if routed:
        layers_top_k = {r.shape[1:] for _, r in routed}
        dtypes = {r.dtype for _, r in routed}
        if len(layers_top_k) > 1 or len(dtypes) > 1:
            raise ValueError(f"routed_experts records disagree: shapes {sorted(layers_top_k)}, dtypes {sorted(map(str, dtypes))}")
        batch["routed_experts"] = np.zeros((*shape, *layers_top_k.pop()), dtypes.pop())
        batch["routed"] = np.zeros(shape, bool)
    supported = any(c.support for c in chains)
    if supported:
        if isinstance(support_capacity, bool) or not isinstance(support_capacity, int) or support_capacity < 1:
            raise ValueError(
                "calls recorded a support, so support_capacity must be a positive integer "
                f"(top-k times the sampled ids a row holds), got {support_capacity!r}"
            )
        batch["support_ids"] = np.full((rows, support_capacity), -1, np.int32)
        batch["support_columns"] = np.full((rows, support_capacity), -1, np.int32)
        support_used = [0] * rows

    for chain, advantage, (row, offset) in zip(chains, chain_advantage, places, strict=True):
        span = slice(offset, offset + len(chain))
        segments_in_row[row] += 1
        response = np.asarray(chain.response, np.int32)
        batch["input_ids"][row, span] = chain.ids
        batch["text_segment_ids"][row, span] = segments_in_row[row]
        batch["text_positions"][row, span] = np.arange(len(chain))
        batch["response_mask"][row, span] = response
        batch["behavior_log_probs"][row, span] = chain.behavior
        if "old_log_probs" in batch:
            batch["old_log_probs"][row, span] = chain.old
        batch["versions"][row, span] = chain.versions
        batch["call_index"][row, span] = chain.calls
        batch["session_index"][row, span] = np.where(response == 1, chain.session, -1)
        batch["advantages"][row, span] = advantage
        batch["session_weights"][row, span] = response / sampled_per_session[chain.session]
        for record in chain.routed:  # later calls' records cover the shared prefix again; the latest wins
            covered = min(len(record), len(chain))
            batch["routed_experts"][row, offset : offset + covered] = record[:covered]
            batch["routed"][row, offset : offset + covered] = True
        for position, kept in chain.support:
            used = support_used[row]
            if used + len(kept) > support_capacity:
                raise ValueError(
                    f"row {row} needs more than support_capacity={support_capacity} support entries "
                    f"(at chain position {position} of {sessions[chain.session].describe()})"
                )
            batch["support_ids"][row, used : used + len(kept)] = kept
            batch["support_columns"][row, used : used + len(kept)] = offset + position
            support_used[row] = used + len(kept)
    return batch


# ----- metrics --------------------------------------------------------------------------------


def session_metrics(
    sessions: Sequence[Session],
    batch: Mapping[str, np.ndarray],
    latencies: Sequence[float] | None = None,
    version: int | None = None,
    truncation: str = "mask",
) -> dict[str, float]:
    """What a batch of sessions says about the rollouts behind it.

    ``sessions/calls_per_chain``; ``masked_share/<status>``: the share of all sampled ids
    that belong to sessions of that status and do not train; ``reward/mean`` over
    trained sessions and ``reward/<component>`` means; with ``latencies`` (seconds)
    ``latency/p50``, ``latency/p90``, ``latency/p99``, ``latency/max``; with the current
    ``version``, ``version_lag/mean`` and ``version_lag/max`` over the batch's sampled ids.
    """
    _check_truncation(truncation)
    metrics: dict[str, float] = {}
    calls = chains = 0
    sampled_total = 0
    masked: dict[str, int] = {status.name.lower(): 0 for status in Status}
    rewards, components = [], {}
    for number, session in enumerate(sessions):
        sampled = sum(len(c.sampled_ids) for c in session.calls)
        sampled_total += sampled
        reward = training_reward(session, truncation)
        if reward is None:
            masked[session.status.name.lower()] += sampled
            continue
        rewards.append(reward)
        for name, value in session.components.items():
            components.setdefault(name, []).append(float(value))
        session_chains = _chains(session, number)
        chains += len(session_chains)
        calls += len({i for chain in session_chains for i in chain.calls if i >= 0})
    metrics["sessions/calls_per_chain"] = calls / chains if chains else 0.0
    for status, count in masked.items():
        metrics[f"masked_share/{status}"] = count / sampled_total if sampled_total else 0.0
    metrics["reward/mean"] = float(np.mean(rewards)) if rewards else float("nan")
    for name, values in components.items():
        metrics[f"reward/{name}"] = float(np.mean(values))
    if latencies:
        values = np.asarray(latencies, np.float64)
        for q in (50, 90, 99):
            metrics[f"latency/p{q}"] = float(np.percentile(values, q))
        metrics["latency/max"] = float(values.max())
    if version is not None:
        mask = np.asarray(batch["response_mask"]) == 1
        if mask.any():
            lag = version - np.asarray(batch["versions"])[mask]
            metrics["version_lag/mean"] = float(lag.mean())
            metrics["version_lag/max"] = float(lag.max())
    return metrics
