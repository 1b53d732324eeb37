"""Policy-gradient losses, KL penalty and behaviour-policy corrections as pure functions of arrays.

The objective classes run the model and hand log-probabilities here, so each loss can be
checked against its reference on fixed tensors. Everything follows verl 0.9.1
(verl/trainer/ppo/core_algos.py and verl/trainer/ppo/rollout_corr_helper.py) formula for
formula, clamps and epsilons included; tools/parity_agentic.py and tools/parity_behavior.py
record verl's outputs and tests/test_agentic_losses.py, tests/test_behavior_losses.py compare
at 1e-6. PPO's critic loss is :mod:`dew.losses.value_loss`.

The surrogates an objective chooses by name ("ppo", "gspo", "cispo", and any a user adds)
are registered in :data:`POLICY_LOSSES`, as verl's ``register_policy_loss``
(``trainer/ppo/core_algos.py``): ``@register_policy_loss("name")`` on a function of one
:class:`SurrogateInputs` that returns the [rows, width] loss matrix before aggregation and
a metrics dict, and ``GRPOObjective(policy_loss="name")`` uses it
without an edit to the objective.

Token arrays are [rows, width]; ``mask`` is a 0/1 float [rows, width]. A packed row holds
several chains, so per-sequence reductions take ``segments`` (int [rows, width], the chain
id of each token, any value where mask is 0) and a static ``num_segments``; with
``segments=None`` each row is one sequence, verl's layout. Masked entries never reach a sum
(verl's masked_sum zeroes them with ``where`` before multiplying by the mask), so padding
may hold any finite value.

One deliberate difference: verl divides by the token count (token-mean) or the sequence
count (seq-mean-token-mean) without a guard, so a batch with no trainable token gives NaN
there; here it gives 0 and a zero gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "session-mean")
SEQUENCE_MODES = ("sum", "mean")
_SAFETY_BOUND = 20.0  # verl clamps log-ratios to +-20 before exponentiating


def _clamp(x: jax.Array, low: float | None = None, high: float | None = None) -> jax.Array:
    """torch.clamp, gradient included: it passes where low <= x <= high, bounds included."""
    if low is not None:
        x = jnp.where(x < low, low, x)
    if high is not None:
        x = jnp.where(x > high, high, x)
    return x


def _masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
    """verl_F.masked_sum over all entries."""
    return (jnp.where(mask != 0, values, 0.0) * mask).sum()


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """verl_F.masked_mean over all entries: masked sum / (mask sum + 1e-8)."""
    return _masked_sum(values, mask) / (mask.sum() + 1e-8)


def _segment_ids(mask: jax.Array, segments: jax.Array | None, num_segments: int | None) -> tuple[jax.Array, int]:
    """Each token's sequence id, masked tokens sent to ``num_segments`` (dropped by segment_sum)."""
    rows, width = mask.shape
    if segments is None:
        if num_segments is not None:
            raise ValueError(f"num_segments needs segments; got num_segments={num_segments} and segments=None")
        segments, num_segments = jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, width)), rows
    elif num_segments is None:
        raise ValueError("segments needs a static num_segments (the number of chains), got None")
    if segments.shape != mask.shape:
        raise ValueError(f"segments must have the mask's shape {mask.shape}, got {segments.shape}")
    return jnp.where(mask != 0, segments, num_segments), num_segments


def _segment_sum(values: jax.Array, ids: jax.Array, num_segments: int) -> jax.Array:
    return jax.ops.segment_sum(values.reshape(-1), ids.reshape(-1), num_segments=num_segments)


def _per_token(per_segment: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(per_segment, ids, mode="clip")  # masked tokens read some segment; the mask drops them


def _check_band(low: float, high: float, name: str = "band") -> None:
    # verl's _parse_rollout_is_threshold / _parse_rollout_rs_thresholds accept 0 < low <= high.
    if not 0 < low <= high:
        raise ValueError(f"{name} needs 0 < low <= high, got low={low}, high={high}")


def aggregate(
    values: jax.Array, mask: jax.Array, mode: str, segments: jax.Array | None = None, num_segments: int | None = None
) -> jax.Array:
    """Reduce a per-token loss matrix to a scalar (verl core_algos.agg_loss).

    values, mask: [rows, width] float32; segments: int [rows, width] or None (one sequence
    per row). ``mode``:

    - "token-mean": sum of masked values / number of masked tokens (verl "token-mean").
    - "session-mean": mean over sequences of each sequence's token mean, sequences without
      a masked token left out (verl "seq-mean-token-mean": per-sequence sum / (count +
      1e-8), then a masked sum over sequences / number of non-empty sequences).

    Returns a float32 scalar.
    """
    if mode == "token-mean":
        count = mask.sum()
        return _masked_sum(values, mask) / jnp.where(count > 0, count, 1.0)
    if mode == "session-mean":
        ids, num_segments = _segment_ids(mask, segments, num_segments)
        counts = _segment_sum(mask, ids, num_segments)
        session = _segment_sum(jnp.where(mask != 0, values, 0.0) * mask, ids, num_segments) / (counts + 1e-8)
        present = (counts > 0).astype(values.dtype)
        sessions = present.sum()
        return _masked_sum(session, present) / jnp.where(sessions > 0, sessions, 1.0)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def ppo_surrogate(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Dual-clipped PPO surrogate per token (verl core_algos.compute_policy_loss_vanilla).

    log_probs, old_log_probs, advantages, mask: [rows, width] float32. The ratio is
    ``exp(clip(log_probs - old_log_probs, -20, 20))``; the loss is
    ``max(-A r, -A clip(r, 1 - epsilon_low, 1 + epsilon_high))``, and where A < 0 it is
    capped at ``-A * dual_clip`` (dual_clip > 1; None leaves the cap off).

    Returns the [rows, width] loss matrix before aggregation (multiply it by detached
    correction weights, then ``aggregate``, as verl applies rollout_is_weights) and the
    token-mean metrics "clipfrac" (share of tokens where the clipped term is larger),
    "ppo_kl" (mean of old - new, clamped log-ratio) and "clipfrac_lower" (share of A < 0
    tokens the dual clip caps; 0 without it).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be greater than 1 (or None), got {dual_clip}")
    old_log_probs, advantages = jax.lax.stop_gradient(old_log_probs), jax.lax.stop_gradient(advantages)
    log_ratio = _clamp(log_probs - old_log_probs, -_SAFETY_BOUND, _SAFETY_BOUND)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * _clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = jnp.maximum(unclipped, clipped)
    metrics = {"clipfrac": _masked_mean((clipped > unclipped).astype(jnp.float32), mask),
               "ppo_kl": _masked_mean(-log_ratio, mask)}
    if dual_clip is None:
        metrics["clipfrac_lower"] = jnp.zeros((), jnp.float32)
    else:
        capped = -advantages * dual_clip
        metrics["clipfrac_lower"] = _masked_mean(((losses > capped) & (advantages < 0)).astype(jnp.float32), mask)
        losses = jnp.where(advantages < 0, jnp.minimum(capped, losses), losses)
    return losses, jax.lax.stop_gradient(metrics)


def gspo_surrogate(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    segments: jax.Array | None,
    num_segments: int | None,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO's clipped sequence-ratio surrogate per token (verl core_algos.compute_policy_loss_gspo).

    log_probs, old_log_probs, advantages, mask: [rows, width] float32; segments: int
    [rows, width] chain ids (None: one chain per row) with static num_segments. Each
    chain's log-ratio is the masked mean of ``log_probs - old_log_probs`` over its tokens
    (count at least 1, no ±20 clamp); the token ratio is
    ``exp(min(log_probs - sg(log_probs) + sg(chain log-ratio), 10))``, so its value is the
    chain's ratio and its gradient the token's. Loss ``max(-A s, -A clip(s, 1 - epsilon_low,
    1 + epsilon_high))``, no dual clip.

    Returns the [rows, width] loss matrix and metrics "clipfrac", "ppo_kl" (token mean of
    old - new, unclamped) and "clipfrac_lower" (always 0, as verl reports it).
    """
    old_log_probs, advantages = jax.lax.stop_gradient(old_log_probs), jax.lax.stop_gradient(advantages)
    ids, num_segments = _segment_ids(mask, segments, num_segments)
    log_ratio = log_probs - old_log_probs
    lengths = jnp.maximum(_segment_sum(mask, ids, num_segments), 1.0)
    chain = _segment_sum(jnp.where(mask != 0, log_ratio, 0.0) * mask, ids, num_segments) / lengths
    token = log_probs - jax.lax.stop_gradient(log_probs) + jax.lax.stop_gradient(_per_token(chain, ids))
    ratio = jnp.exp(_clamp(token, high=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * _clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    metrics = {"clipfrac": _masked_mean((clipped > unclipped).astype(jnp.float32), mask),
               "ppo_kl": _masked_mean(-log_ratio, mask), "clipfrac_lower": jnp.zeros((), jnp.float32)}
    return jnp.maximum(unclipped, clipped), jax.lax.stop_gradient(metrics)


def cispo_surrogate(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO per token: ``-sg(clip(r, 1 - epsilon_low, 1 + epsilon_high)) * A * log_probs``
    (verl core_algos.compute_policy_loss_cispo; MiniMax-M1 sets epsilon_low large, no lower bound).

    log_probs, old_log_probs, advantages, mask: [rows, width] float32; r =
    ``exp(clip(log_probs - old_log_probs, -20, 20))``. Every token keeps a gradient, scaled by
    its clipped ratio. Returns the [rows, width] loss matrix and metrics "clipfrac" (share of
    tokens whose ratio was clipped), "ppo_kl" (clamped) and "clipfrac_lower" (always 0).
    """
    old_log_probs, advantages = jax.lax.stop_gradient(old_log_probs), jax.lax.stop_gradient(advantages)
    log_ratio = _clamp(log_probs - old_log_probs, -_SAFETY_BOUND, _SAFETY_BOUND)
    ratio = jnp.exp(log_ratio)
    clipped = _clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -jax.lax.stop_gradient(clipped) * advantages * log_probs
    metrics = {"clipfrac": _masked_mean((ratio != clipped).astype(jnp.float32), mask),
               "ppo_kl": _masked_mean(-log_ratio, mask), "clipfrac_lower": jnp.zeros((), jnp.float32)}
    return losses, jax.lax.stop_gradient(metrics)


@dataclasses.dataclass(frozen=True)
class SurrogateInputs:
    """What the objective hands every registered surrogate (inside the compiled loss).

    log_probs: [rows, width] float32 under the policy being trained; old_log_probs: the old
    policy's (behaviour's, in verl's bypass mode); advantages, mask: [rows, width] (mask 0/1);
    segments: int [rows, width], each token's chain id, with the static ``num_segments``;
    epsilon_low, epsilon_high: the clip range; dual_clip: the dual-clip bound or None.
    A surrogate uses what it needs and ignores the rest.
    """

    log_probs: jax.Array
    old_log_probs: jax.Array
    advantages: jax.Array
    mask: jax.Array
    segments: jax.Array
    num_segments: int
    epsilon_low: float
    epsilon_high: float
    dual_clip: float | None


PolicyLoss = Callable[[SurrogateInputs], tuple[jax.Array, dict[str, jax.Array]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a surrogate under ``name`` (a decorator; see the module docstring).

    A name is registered once: a second function under a taken name raises ValueError
    naming it, so a plug-in cannot silently replace "ppo".
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy loss is registered under a non-empty name, got {name!r}")

    def decorator(function: PolicyLoss) -> PolicyLoss:
        if not callable(function):
            raise TypeError(f"policy loss {name!r} must be callable on SurrogateInputs, got {function!r}")
        taken = POLICY_LOSSES.get(name)
        if taken is not None and taken is not function:
            raise ValueError(f"policy loss {name!r} is already registered ({taken.__module__}.{taken.__qualname__}); "
                             "register yours under another name")
        POLICY_LOSSES[name] = function
        return function

    return decorator


def policy_loss_fn(name: str) -> PolicyLoss:
    """The surrogate registered under ``name``; ValueError naming the registered ones otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of the registered surrogates {sorted(POLICY_LOSSES)}, got "
                         f"{name!r}; add one with dew.losses.policy.register_policy_loss")
    return POLICY_LOSSES[name]


@register_policy_loss("ppo")
def _ppo(inputs: SurrogateInputs):
    return ppo_surrogate(inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask,
                         inputs.epsilon_low, inputs.epsilon_high, inputs.dual_clip)


@register_policy_loss("gspo")
def _gspo(inputs: SurrogateInputs):
    return gspo_surrogate(inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask, inputs.segments,
                          inputs.num_segments, inputs.epsilon_low, inputs.epsilon_high)


@register_policy_loss("cispo")
def _cispo(inputs: SurrogateInputs):
    return cispo_surrogate(inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask,
                           inputs.epsilon_low, inputs.epsilon_high)


def k3_kl(log_probs: jax.Array, ref_log_probs: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(pi || ref) (verl core_algos.kl_penalty(..., "low_var_kl")).

    log_probs, ref_log_probs: [rows, width] float32 -> [rows, width]:
    ``clip(exp(d) - d - 1, -10, 10)`` with ``d = clip(ref - log_probs, -20, 20)``; both
    clamps stop the gradient outside their range, as torch.clamp does.
    """
    d = _clamp(jax.lax.stop_gradient(ref_log_probs) - log_probs, -_SAFETY_BOUND, _SAFETY_BOUND)
    return _clamp(jnp.exp(d) - d - 1, -10.0, 10.0)


def token_tis_weights(
    old_log_probs: jax.Array, behavior_log_probs: jax.Array, cap: float, mask: jax.Array | None = None
) -> jax.Array:
    """Detached token truncated-importance weights ``min(exp(clip(old - behavior, -20, 20)), cap)``
    (verl rollout_corr_helper.compute_rollout_correction_weights, rollout_is="token", a
    single-number threshold).

    old_log_probs, behavior_log_probs: [rows, width] float32; mask: optional [rows, width],
    zeroing padding as verl does. Returns [rows, width] float32 with no gradient.
    """
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    weights = jnp.exp(_clamp(old_log_probs - behavior_log_probs, -_SAFETY_BOUND, _SAFETY_BOUND))
    if mask is not None:
        weights = weights * mask
    return jax.lax.stop_gradient(jnp.minimum(weights, cap))


def icepop_weights(
    old_log_probs: jax.Array, behavior_log_probs: jax.Array, low: float, high: float, mask: jax.Array | None = None
) -> jax.Array:
    """Detached IcePop weights (verl compute_rollout_correction_weights, rollout_is="token",
    threshold "low_high"): the token ratio ``exp(clip(old - behavior, -20, 20))`` where it
    lies in [low, high], 0 outside.

    Inside the band verl keeps the ratio itself, not 1. old_log_probs, behavior_log_probs:
    [rows, width] float32; mask: optional [rows, width] (a masked token gets 0). Returns
    [rows, width] float32 with no gradient.
    """
    _check_band(low, high, "icepop band")
    weights = jnp.exp(_clamp(old_log_probs - behavior_log_probs, -_SAFETY_BOUND, _SAFETY_BOUND))
    if mask is not None:
        weights = weights * mask
    return jax.lax.stop_gradient(jnp.where((weights >= low) & (weights <= high), weights, 0.0))


def token_band_mask(log_ratio: jax.Array, mask: jax.Array, low: float, high: float) -> jax.Array:
    """Keep a token when ``log(low) <= clip(log_ratio, -20, 20) <= log(high)``; returns mask * keep.

    log_ratio: [rows, width] float32, log(pi / mu); mask: [rows, width]. verl's token_k1
    rejection (compute_rollout_rejection_mask) tests k1 = -log_ratio, so this is verl with
    rollout_rs_threshold ``f"{1 / high}_{1 / low}"``. Returns [rows, width], mask's dtype, no gradient.
    """
    _check_band(low, high, "token band")
    log_ratio = jax.lax.stop_gradient(_clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND))
    keep = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    return keep.astype(mask.dtype) * mask


def sequence_mask(
    log_ratio: jax.Array,
    mask: jax.Array,
    segments: jax.Array | None,
    num_segments: int | None,
    low: float,
    high: float,
    mode: str,
) -> jax.Array:
    """Keep a whole chain when its summed ("sum") or mean ("mean") k1 = -log(pi / mu) lies in
    [log(low), log(high)]; returns mask * keep per token.

    log_ratio: [rows, width] float32, log(pi / mu), clipped to ±20 per token; mask:
    [rows, width]; segments: int [rows, width] chain ids (None: one chain per row) with
    static num_segments. "sum" tests the chain's summed k1 = log prod(mu / pi), "mean" its
    mean over the chain's tokens (masked sum / (count + 1e-8)). This is verl's seq_sum_k1 and
    seq_mean_k1 rejection (compute_rollout_rejection_mask) with rollout_rs_threshold
    ``f"{low}_{high}"``: a verl band carries over unchanged. Returns [rows, width], mask's
    dtype, no gradient.
    """
    if mode not in SEQUENCE_MODES:
        raise ValueError(f"sequence mask mode must be one of {SEQUENCE_MODES}, got {mode!r}")
    _check_band(low, high, "sequence band")
    k1 = -jax.lax.stop_gradient(_clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND))
    ids, num_segments = _segment_ids(mask, segments, num_segments)
    statistic = _segment_sum(jnp.where(mask != 0, k1, 0.0) * mask, ids, num_segments)
    if mode == "mean":
        statistic = statistic / (_segment_sum(mask, ids, num_segments) + 1e-8)
    keep = (statistic >= math.log(low)) & (statistic <= math.log(high))
    return _per_token(keep, ids).astype(mask.dtype) * mask


def mismatch_metrics(
    old_log_probs: jax.Array, behavior_log_probs: jax.Array, mask: jax.Array, cap: float | None = None
) -> dict[str, jax.Array]:
    """Trainer-engine mismatch over masked tokens, as verl's off-policy diagnostics define them.

    old_log_probs (the trainer's pi), behavior_log_probs (the engine's mu), mask: [rows, width].
    With r = pi / mu per token:

    - "kl": mean of log mu - log pi, the k1 estimate of KL(mu || pi) on mu's samples
      (rollout_corr_helper.compute_offpolicy_metrics "kl");
    - "k3_kl": mean of r - log r - 1, unclamped (compute_offpolicy_metrics "k3_kl");
    - "ess": normalized effective sample size 1 / mean((w / (mean(w) + 1e-8))^2) of the
      weights w = min(exp(clip(log r, -20, 20)), cap), in (0, 1]
      (compute_is_metrics "rollout_is_eff_sample_size"; cap=None is verl with threshold inf).

    Returns float32 scalars with no gradient.
    """
    old_log_probs, behavior_log_probs = jax.lax.stop_gradient(old_log_probs), jax.lax.stop_gradient(behavior_log_probs)
    log_ratio = old_log_probs - behavior_log_probs
    weights = jnp.exp(_clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND)) * mask
    if cap is not None:
        if not cap > 0:
            raise ValueError(f"cap must be positive (or None), got {cap}")
        weights = jnp.minimum(weights, cap)
    normalized = weights / (_masked_mean(weights, mask) + 1e-8)
    return {
        "kl": _masked_mean(behavior_log_probs - old_log_probs, mask),
        "k3_kl": _masked_mean(jnp.exp(log_ratio) - log_ratio - 1, mask),
        "ess": 1.0 / _masked_mean(normalized**2, mask),
    }


LAG_BUCKETS = ("0", "1", "2plus")  # how lag shares are reported: this lag, or 2 and more


def lag_shares(lags: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """The share of masked tokens whose weights are 0, 1, and 2 or more updates behind the trained ones.

    lags: [rows, width] int (RolloutScheduler's ``lags`` column); mask: [rows, width] 0/1.
    Keys are :data:`LAG_BUCKETS`; all zero when nothing is masked in. Works on host
    (numpy) arrays as on traced ones.
    """
    mask = jnp.asarray(mask, jnp.float32)
    total = jnp.maximum(mask.sum(), 1.0)
    return {name: (mask * at).sum() / total for name, at in zip(LAG_BUCKETS, (lags == 0, lags == 1, lags >= 2))}
