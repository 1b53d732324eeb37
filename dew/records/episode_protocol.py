"""The environment protocol of tool episodes: what an environment sees and returns.

An environment factory receives an :class:`EpisodeId` (the integer task id, the
attempted step, the sample index within the group and a seed) and returns an
:class:`Environment`, used as a context manager. ``reset()`` returns the first
:class:`Observation`; ``step(action)`` takes one finished model turn, an
:class:`Action`, and returns the exact next context or a terminal result. An
:class:`Episode` keeps the reset observation and every :class:`Transition`.

Statuses are an enum, :class:`EpisodeStatus`; ``Observation`` also accepts the
enum's string values ("running", "completed", "truncated", "cancelled", "error") and
stores the enum. Token ids are checked once, by :func:`dew.records.actions.token_ids` (non-negative integers, booleans
refused, numpy integers converted to ``int``); their upper bound is the caller's to
check, since only it knows the vocabulary.

``Environment.metrics()`` is optional: numbers the environment reports about its episode
(tool calls, tool errors), which :class:`~dew.collection.sources.EnvironmentSource` keeps on
the session and the scheduler logs as ``episode/<name>``. ``Environment.get_state()`` / ``set_state(state)`` are optional: only a journal needs
them, to snapshot and restore the tool state between turns. The base class raises
``NotImplementedError`` for both. The collection loop (``EpisodeRollout``) lives
elsewhere; this module holds only the protocol.
"""

from __future__ import annotations

import abc
import dataclasses
import enum

from dew.records.actions import token_ids
from dew.validation import integer

SNAPSHOTS_OPTIONAL = "snapshots are needed only when episodes are journaled"


class EpisodeStatus(enum.Enum):
    """Where an episode stands after an observation."""

    RUNNING = "running"  # the observation's context is the next model call's input
    COMPLETED = "completed"  # the environment ended the episode normally
    TRUNCATED = "truncated"  # a token, context, turn or time limit cut it off
    CANCELLED = "cancelled"  # stopped from outside before it finished
    ERROR = "error"  # the environment or its tool failed; ``detail`` says how


class EnvironmentFailure(RuntimeError):
    """An environment operation that must not be papered over failed (a snapshot or a restore).

    Named so rather than ``EnvironmentError``, which is Python's alias of ``OSError``.
    """


@dataclasses.dataclass(frozen=True)
class EpisodeId:
    """Which episode an environment serves: task id, attempted training step, sample index in the group, seed."""

    task: int
    step: int
    sample: int
    seed: int

    def __post_init__(self):
        for name in ("task", "step", "sample"):
            integer(f"EpisodeId.{name}", getattr(self, name), at_least=0)
        integer("EpisodeId.seed", self.seed)


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the environment returns: the exact next context ids, a status and a detail string.

    A running observation carries the next model call's whole context (non-empty); a
    terminal one may carry an empty context. ``status`` is stored as an
    :class:`EpisodeStatus`; its string value is accepted too.
    """

    context: tuple[int, ...]
    status: EpisodeStatus = EpisodeStatus.RUNNING
    detail: str = ""

    def __post_init__(self):
        try:
            status = EpisodeStatus(self.status)
        except ValueError:
            allowed = [member.value for member in EpisodeStatus]
            raise ValueError(f"Observation.status must be one of {allowed}, got {self.status!r}") from None
        object.__setattr__(self, "status", status)
        object.__setattr__(
            self, "context", token_ids("Observation.context", self.context, nonempty=status is EpisodeStatus.RUNNING)
        )
        if not isinstance(self.detail, str):
            raise ValueError(f"Observation.detail must be a string, got {type(self.detail).__name__}")

    @property
    def terminal(self) -> bool:
        """Whether the episode ended with this observation."""
        return self.status is not EpisodeStatus.RUNNING


@dataclasses.dataclass(frozen=True)
class Action:
    """One finished model turn: the context it read, the ids it sampled, whether it ended on EOS, the policy step.

    ``tokens`` includes the EOS id when ``eos`` is true, so an EOS turn holds at least
    one token; ``policy_step`` is the committed update clock of the weights that sampled it
    (-1 for the weights a rollout server serves before the trainer's first push, such as an
    RLVR pipeline's warm-started policy).
    """

    context: tuple[int, ...]
    tokens: tuple[int, ...]
    eos: bool
    policy_step: int

    def __post_init__(self):
        object.__setattr__(self, "context", token_ids("Action.context", self.context, nonempty=True))
        object.__setattr__(self, "tokens", token_ids("Action.tokens", self.tokens))
        if not isinstance(self.eos, bool):
            raise ValueError(f"Action.eos must be a bool, got {self.eos!r}")
        if self.eos and not self.tokens:
            raise ValueError("Action.eos is true but Action.tokens is empty; the EOS id is one of the sampled tokens")
        integer("Action.policy_step", self.policy_step, at_least=-1)


@dataclasses.dataclass(frozen=True)
class Transition:
    """One turn of an episode: the model's action and the environment's observation after it."""

    action: Action
    observation: Observation

    def __post_init__(self):
        if not isinstance(self.action, Action):
            raise ValueError(f"Transition.action must be an Action, got {type(self.action).__name__}")
        if not isinstance(self.observation, Observation):
            raise ValueError(f"Transition.observation must be an Observation, got {type(self.observation).__name__}")


@dataclasses.dataclass
class Episode:
    """An episode so far: its identity, the reset observation and its transitions in order."""

    id: EpisodeId
    reset: Observation
    transitions: list[Transition] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.id, EpisodeId):
            raise ValueError(f"Episode.id must be an EpisodeId, got {type(self.id).__name__}")
        if not isinstance(self.reset, Observation):
            raise ValueError(f"Episode.reset must be an Observation, got {type(self.reset).__name__}")
        self.transitions = list(self.transitions)
        for index, transition in enumerate(self.transitions):
            if not isinstance(transition, Transition):
                raise ValueError(f"Episode.transitions[{index}] must be a Transition, got {type(transition).__name__}")

    @property
    def last(self) -> Observation:
        """The latest observation: the last transition's, or the reset's before any step."""
        return self.transitions[-1].observation if self.transitions else self.reset

    @property
    def status(self) -> EpisodeStatus:
        return self.last.status

    @property
    def detail(self) -> str:
        return self.last.detail


class Environment(abc.ABC):
    """One episode's environment; use it as a context manager so ``close()`` releases its resources.

    ``reset`` and ``step`` are required. ``get_state`` / ``set_state`` are optional and
    needed only with a journal: they must snapshot and restore all the tool and
    workspace state later calls or the verifier rely on.
    """

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @abc.abstractmethod
    def reset(self) -> Observation:
        """Start the episode and return the first context."""

    @abc.abstractmethod
    def step(self, action: Action) -> Observation:
        """Apply one finished model turn; return the exact next context or a terminal observation."""

    def metrics(self) -> dict[str, float]:
        """Numbers about this episode so far (optional; default none), read once the episode has ended."""
        return {}

    def get_state(self) -> bytes:
        """A snapshot of the environment's state (optional; only a journal needs it)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get_state(); {SNAPSHOTS_OPTIONAL}")

    def set_state(self, state: bytes) -> None:
        """Restore a snapshot taken by ``get_state`` (optional; only a journal needs it)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement set_state(); {SNAPSHOTS_OPTIONAL}")

    def close(self) -> None:
        """Release the environment's resources; called on exit from the ``with`` block. Safe to call twice."""
