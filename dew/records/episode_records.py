"""Host records of tool episodes and ``session_of``: an episode as a Session the packer trains.

The environment protocol (:mod:`dew.records.episode_protocol`) carries what an environment sees:
an :class:`~dew.records.episode_protocol.Action` has the context, the sampled ids, the
termination flag and the policy step, and nothing of the likelihoods. The host keeps those
beside it: an :class:`ActionRecord` is one action with the raw (``old_log_probs``) and
behaviour log-probabilities the inference call reported for its ids, copied as they came,
never retokenized or rescored. An :class:`EpisodeRecord` is an episode with one action
record per transition, its reward, and the identity of the collection binding that
produced it (``origin``: compared by identity, not a version handle nor a weight hash).

``session_of(record, group=...)`` makes each action a :class:`~dew.records.session_records.Call`,
so ``pack`` merges turns into one chain when the next context starts with the previous
context plus its sampled ids, and starts a new chain otherwise.
"""

from __future__ import annotations

import dataclasses

from dew.records.actions import check_action
from dew.records.episode_protocol import Action, Episode, EpisodeStatus
from dew.records.session_records import Call, Session, Status, Task
from dew.validation import integer

STATUSES = {
    EpisodeStatus.COMPLETED: Status.COMPLETED,
    EpisodeStatus.TRUNCATED: Status.TRUNCATED,
    EpisodeStatus.CANCELLED: Status.CANCELLED,
    EpisodeStatus.ERROR: Status.INFRA_ERROR,
    EpisodeStatus.RUNNING: Status.INFRA_ERROR,  # an episode that never ended trains on nothing
}


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    """One action and the likelihoods the inference call reported for its sampled ids."""

    action: Action
    old_log_probs: tuple[float, ...]
    behavior_log_probs: tuple[float, ...]

    def __post_init__(self):
        if not isinstance(self.action, Action):
            raise ValueError(f"ActionRecord.action must be an Action, got {type(self.action).__name__}")
        object.__setattr__(self, "old_log_probs", tuple(float(x) for x in self.old_log_probs))
        object.__setattr__(self, "behavior_log_probs", tuple(float(x) for x in self.behavior_log_probs))
        check_action("ActionRecord", self.action.context, self.action.tokens, self.behavior_log_probs,
                     self.old_log_probs, names=("action.context", "action.tokens"))


@dataclasses.dataclass
class EpisodeRecord:
    """An episode on the host: its transitions' likelihoods (``actions``, one per transition), reward and origin.

    ``group``: the batch row of its task (advantages compare the episodes of one row);
    ``truncated``: why a host limit (context or turns) ended it while the environment
    still had it running, or "" (the recorded turns stay whole either way).
    """

    episode: Episode
    actions: list[ActionRecord]
    reward: float | None = None
    origin: object = dataclasses.field(default=None, compare=False)  # never part of equality: replays compare equal
    group: int = 0
    truncated: str = ""

    @property
    def status(self) -> EpisodeStatus:
        return EpisodeStatus.TRUNCATED if self.truncated else self.episode.status

    @property
    def detail(self) -> str:
        return self.truncated or self.episode.detail

    def describe(self) -> str:
        identity = self.episode.id
        return f"episode (task {identity.task}, step {identity.step}, sample {identity.sample})"


def session_of(record: EpisodeRecord, group: int | None = None) -> Session:
    """The record as a Session: task ``str(task id)``, ``group`` (default: the record's), the episode's sample,
    one call per action."""
    if not isinstance(record, EpisodeRecord):
        raise TypeError(f"session_of takes an EpisodeRecord, got {type(record).__name__}")
    group = record.group if group is None else integer("group", group, at_least=0)
    transitions = record.episode.transitions
    if len(record.actions) != len(transitions):
        raise ValueError(f"{record.describe()}: {len(record.actions)} action records for {len(transitions)} transitions")
    calls = []
    for index, (kept, transition) in enumerate(zip(record.actions, transitions, strict=True)):
        if kept.action != transition.action:
            raise ValueError(f"{record.describe()}: action record {index} is not the action of transition {index}")
        action = kept.action
        calls.append(Call(prompt_ids=list(action.context), sampled_ids=list(action.tokens),
                          behavior_log_probs=list(kept.behavior_log_probs), old_log_probs=list(kept.old_log_probs),
                          finish_reason="stop" if action.eos else "length", version=action.policy_step))
    identity = record.episode.id
    return Session(task=Task(str(identity.task), {"task_id": identity.task}), group=group, sample=identity.sample,
                   attempt=0, calls=calls, status=STATUSES[record.status], reward=record.reward,
                   detail=record.detail)
