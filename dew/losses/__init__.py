"""Pure math: losses and advantage estimators as functions of arrays; they never run a model.

``policy``: the GRPO/PPO surrogates, aggregation, the k3 KL, behaviour-policy weights and
masks (verl 0.9.1); ``advantages``: group-relative outcome advantages; ``preference``: DPO.
"""

from dew.losses.advantages import ESTIMATORS, group_advantages
from dew.losses.policy import (
    AGGREGATIONS,
    SEQUENCE_MODES,
    aggregate,
    cispo_surrogate,
    gspo_surrogate,
    icepop_weights,
    k3_kl,
    mismatch_metrics,
    ppo_surrogate,
    sequence_mask,
    token_band_mask,
    token_tis_weights,
)
from dew.losses.dpo_loss import dpo_loss, sequence_log_probs

__all__ = [
    "AGGREGATIONS", "ESTIMATORS", "SEQUENCE_MODES", "aggregate", "cispo_surrogate", "dpo_loss", "group_advantages",
    "gspo_surrogate", "icepop_weights", "k3_kl", "mismatch_metrics", "ppo_surrogate", "sequence_log_probs",
    "sequence_mask", "token_band_mask", "token_tis_weights",
]
