"""Preference and reinforcement-learning objectives."""

from dew.objectives.rl.dpo import DPOObjective
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.rollout import SampledRollout

__all__ = ["DPOObjective", "GRPOObjective", "SampledRollout"]
