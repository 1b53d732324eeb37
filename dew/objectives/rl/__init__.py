"""The spec's ``dew.objectives.rl``: its import paths, and nothing else.

Every name here lives in its own layer and is re-exported unchanged: the objectives from
:mod:`dew.objectives` (``dpo``, ``grpo``, ``ppo``, ``flow_grpo``), the episode protocol and
records from :mod:`dew.records`, the collectors (SampledRollout, the sources,
RolloutScheduler and its task converters, EpisodeRollout, PPORollout, FlowRollout,
EpisodeJournal) from :mod:`dew.collection`. ``dew.objectives.rl.sessions``,
``dew.objectives.rl.verl`` and ``dew.objectives.rl.harbor`` are the spec's module paths for
the session records, their verl rows and HarborSource. Code inside the project imports each
name from its home, never from here, so this package sets no layer (a test checks both).
"""

from dew.collection.flow_rollout import FlowRollout
from dew.collection.episode_rollout import EpisodeCancelled, EpisodeFailure, EpisodeRollout
from dew.collection.journal import EpisodeJournal, JournalError
from dew.collection.ppo_rollout import PPORollout
from dew.collection.sampled_rollout import SampledRollout
from dew.collection.scheduler import RolloutScheduler, SchedulerRecord
from dew.collection.sources import EnvironmentSource, PromptSource
from dew.collection.tasks import prompt_tasks, task_ids
from dew.flow.trajectory import FlowTrajectory, sample_trajectory
from dew.objectives.dpo import DPOObjective
from dew.objectives.flow_grpo import FlowGRPOObjective
from dew.objectives.grpo import GRPOObjective
from dew.objectives.ppo import PPOObjective, ValueHead
from dew.records.episode_records import ActionRecord, EpisodeRecord, session_of
from dew.records.episode_protocol import Action, Environment, Episode, EpisodeId, EpisodeStatus, Observation, Transition

__all__ = [
    "Action", "ActionRecord", "DPOObjective", "Environment", "EnvironmentSource", "Episode", "EpisodeCancelled",
    "EpisodeFailure", "EpisodeId", "FlowGRPOObjective", "FlowRollout", "FlowTrajectory", "EpisodeJournal", "EpisodeRecord", "EpisodeRollout", "EpisodeStatus",
    "GRPOObjective", "JournalError", "Observation", "PPOObjective", "PPORollout", "PromptSource", "RolloutScheduler",
    "SampledRollout", "SchedulerRecord", "Transition", "ValueHead", "prompt_tasks", "sample_trajectory", "session_of", "task_ids",
]
