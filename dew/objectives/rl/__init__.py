"""The spec's ``dew.objectives.rl``: preference and RL objectives, and what collects their batches.

The objectives live here (``dpo``, ``grpo``, ``ppo``, ``flow_grpo``). The names the
spec imports from this package that belong to other layers are re-exported from their
homes: the episode protocol and records from :mod:`dew.records`, the collectors
(SampledRollout, the sources, RolloutScheduler and its task converters) from
:mod:`dew.collection`. ``dew.objectives.rl.sessions`` is the spec's module path for the
records, ``dew.objectives.rl.verl`` for their verl rows and ``dew.objectives.rl.harbor``
for HarborSource.
"""

from dew.collection.flow import FlowRollout
from dew.collection.episodes import EpisodeCancelled, EpisodeFailure, EpisodeRollout
from dew.collection.journal import EpisodeJournal, JournalError
from dew.collection.ppo import PPORollout
from dew.collection.rollout import SampledRollout
from dew.collection.scheduler import RolloutScheduler, SchedulerRecord
from dew.collection.sources import EnvironmentSource, PromptSource
from dew.collection.tasks import prompt_tasks, task_ids
from dew.flow.trajectory import FlowTrajectory, sample_trajectory
from dew.objectives.rl.dpo import DPOObjective
from dew.objectives.rl.flow_grpo import FlowGRPOObjective
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.ppo import PPOObjective, ValueHead
from dew.records.episode_sessions import ActionRecord, EpisodeRecord, session_of
from dew.records.episodes import Action, Environment, Episode, EpisodeId, EpisodeStatus, Observation, Transition

__all__ = [
    "Action", "ActionRecord", "DPOObjective", "Environment", "EnvironmentSource", "Episode", "EpisodeCancelled",
    "EpisodeFailure", "EpisodeId", "FlowGRPOObjective", "FlowRollout", "FlowTrajectory", "EpisodeJournal", "EpisodeRecord", "EpisodeRollout", "EpisodeStatus",
    "GRPOObjective", "JournalError", "Observation", "PPOObjective", "PPORollout", "PromptSource", "RolloutScheduler",
    "SampledRollout", "SchedulerRecord", "Transition", "ValueHead", "prompt_tasks", "sample_trajectory", "session_of", "task_ids",
]
