"""Training objectives; each follows the protocol in :mod:`dew.objectives.base`."""

from dew.objectives.base import Objective
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.lm import LMObjective

__all__ = ["DiffusionObjective", "LMObjective", "Objective"]
