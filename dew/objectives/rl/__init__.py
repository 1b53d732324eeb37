"""Preference and reinforcement-learning objectives."""

from dew.objectives.rl.dpo import DPOObjective

__all__ = ["DPOObjective"]
