"""Pure math: losses and advantage estimators as functions of arrays; they never run a model.

``policy``: the GRPO/PPO surrogates and their registry (``register_policy_loss``),
aggregation, the k3 KL, behaviour-policy weights and masks (verl 0.9.1); ``advantages``:
group-relative outcome advantages; ``gae``: PPO's GAE and whitening; ``value_loss``: PPO's
clipped critic loss; ``dpo_loss``: DPO; ``flow_sde``: Flow-GRPO's SDE transition.
"""

from dew.losses.advantages import ESTIMATORS, group_advantages
from dew.losses.policy import (
    AGGREGATIONS,
    POLICY_LOSSES,
    SEQUENCE_MODES,
    SurrogateInputs,
    aggregate,
    cispo_surrogate,
    gspo_surrogate,
    icepop_weights,
    k3_kl,
    mismatch_metrics,
    policy_loss_fn,
    ppo_surrogate,
    register_policy_loss,
    sequence_mask,
    token_band_mask,
    token_tis_weights,
)
from dew.losses.dpo_loss import dpo_loss, sequence_log_probs

__all__ = [
    "AGGREGATIONS", "ESTIMATORS", "POLICY_LOSSES", "SEQUENCE_MODES", "SurrogateInputs", "aggregate", "cispo_surrogate",
    "dpo_loss", "group_advantages", "gspo_surrogate", "icepop_weights", "k3_kl", "mismatch_metrics", "policy_loss_fn",
    "ppo_surrogate", "register_policy_loss", "sequence_log_probs", "sequence_mask", "token_band_mask",
    "token_tis_weights",
]
