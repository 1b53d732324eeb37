"""Training objectives; each follows the protocol in :mod:`dew.objectives.base`.

``lm`` (SFT), ``dpo``, ``grpo``, ``ppo`` (with a critic), ``diffusion`` (rectified flow) and
``flow_grpo``. The spec imports the preference and RL ones through :mod:`dew.objectives.rl`.
"""

from dew.objectives.base import Objective
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.dpo import DPOObjective
from dew.objectives.flow_grpo import FlowGRPOObjective
from dew.objectives.grpo import GRPOObjective
from dew.objectives.lm import LMObjective
from dew.objectives.ppo import PPOObjective

__all__ = ["DPOObjective", "DiffusionObjective", "FlowGRPOObjective", "GRPOObjective", "LMObjective", "Objective",
           "PPOObjective"]
