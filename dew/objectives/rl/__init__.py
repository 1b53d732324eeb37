"""Preference and reinforcement-learning objectives."""

from dew.objectives.rl.dpo import DPOObjective
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.rollout import SampledRollout
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord
from dew.objectives.rl.sources import EnvironmentSource, PromptSource

__all__ = [
    "DPOObjective", "EnvironmentSource", "GRPOObjective", "PromptSource", "RolloutScheduler", "SampledRollout",
    "SchedulerRecord",
]
