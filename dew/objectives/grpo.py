"""Group-relative policy optimisation on packed rows: ``GRPOObjective``.

The batch is what :func:`dew.records.session_packing.pack` builds (``SampledRollout``
and the schedulers use it): ``[rows, seq_len + 1]`` columns ``input_ids``,
``text_segment_ids``, ``text_positions``, ``response_mask``, ``behavior_log_probs``,
``advantages`` and ``session_index``, optionally ``old_log_probs`` (raw old-policy
likelihoods), ``support_ids``/``support_columns`` and ``text_prefix_segments`` (a group's
prompt written once for its samples: ``pack(..., share_prompts=True)``). Each id is scored
against its own chain's prefix (:meth:`GRPOObjective.packed_log_probs`).

The policy term is a clipped ratio between the current and the old raw policy
(``policy_loss``: "ppo", "gspo", "cispo" or any surrogate registered with
:func:`dew.losses.policy.register_policy_loss`), reduced by ``aggregation`` ("token-mean"
or "session-mean"). With ``beta > 0`` a k3 KL to the frozen starting policy (kept in
the EMA slot, decay 1) is added with the same reduction; with ``beta == 0`` no
reference is kept.

Behaviour corrections, off unless asked for:

- ``behavior_importance=c``: the token TIS weight ``min(exp(clip(old - behavior, -20,
  20)), c)``, detached, multiplies the surrogate before the reduction (needs
  ``old_log_probs``); ``(lo, hi)``: IcePop, weight 0 outside the ratio band;
- ``sequence_mask=(lo, hi)`` / ``geometric_mask=(lo, hi)``: drop a chain whose summed /
  mean k1 = -log(pi / mu) leaves ``[log lo, log hi]``, verl's seq_sum_k1 / seq_mean_k1
  rejection with ``rollout_rs_threshold="lo_hi"`` unchanged.

Per-token versions, off unless asked for: ``max_token_lag=k`` drops every sampled id more than
k updates older than the weights being trained (the batch's ``lags`` column, which
:class:`~dew.collection.scheduler.RolloutScheduler` writes from pack's per-id ``versions``);
with ``stale_token_weight=w`` in (0, 1) such ids are down-weighted by w instead. Whenever a
batch has ``lags`` the loss reports ``lag/share_0``, ``lag/share_1`` and ``lag/share_2plus``,
the share of trainable ids at each lag.

``proximal="current"`` takes the old policy to be the one being trained, detached, in place of a
batch's ``old_log_probs``: the same numbers a rescoring under the trainer's weights gives when
each batch makes one optimizer update (the Trainer's rollout, where the scheduler rescored with
a forward pass of its own), without that pass (:class:`~dew.collection.scheduler.RolloutScheduler`
skips it for such an objective). A TIS cap then weighs each id by ``min(exp(current - behavior), c)``.
It is wrong where one batch makes several updates (PPO epochs), so it is an option, not a guess.

Without ``old_log_probs`` the loss runs in verl's bypass mode: the behaviour
likelihoods stand in for the old policy, the band and the sequence masks compare the
detached current policy with behaviour, the band only masks (out-of-band tokens leave
the token-mean denominator) and a TIS cap is refused. The loss reports
``mismatch/kl``, ``mismatch/k3_kl`` and ``mismatch/ess`` between the old (or, in
bypass mode, current) policy and behaviour, and ``removed/<mask>``, the share of
trainable tokens each mask removed.

Validation scores prompt perplexity over the real next-token transitions of ``Prompts``
batches (``prompt`` left-padded, ``prompt_length``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.base import (
    Objective,
    Variables,
    check_integer_field,
    check_seq_len,
    check_variables,
    check_vocabulary,
    require_field,
)
from dew.objectives.lm import token_log_probs
from dew.losses import policy as losses
from dew.losses.policy import AGGREGATIONS
from dew.models.packed_attention import SharedPromptRows
from dew.validation import band, integer, number, one_of, positive

REQUIRED = ("input_ids", "text_segment_ids", "text_positions", "response_mask", "behavior_log_probs", "advantages")
INTEGER = ("input_ids", "text_segment_ids", "text_positions", "response_mask", "lags", "text_prefix_segments")
PROXIMAL = ("batch", "current")
_UNSET = object()


class GRPOObjective(Objective):
    """GRPO on packed rows (see the module docstring).

    seq_len: predicted positions, one fewer than the batch width (``P + R - 1`` for
    ``SampledRollout``). beta: the k3 KL coefficient (0 keeps no reference).
    pretrained: a full Flax variables mapping to start from (and the reference).
    epsilon_low, epsilon_high: the clip range; dual_clip: the dual-clip bound for
    negative advantages (``None`` turns it off; "ppo" only). proximal: "batch" (the old
    policy is the batch's ``old_log_probs``, or behaviour in bypass mode) or "current" (the
    trained policy, detached: see the module docstring). layout: the batches' rows hold one shared prompt and its
    samples (:class:`~dew.models.packed_attention.SharedPromptRows`, as ``pack(..., layout=...)`` writes them),
    so attention computes only the blocks they need; ``seq_len + 1`` must be its width, and a batch may have
    fewer or shorter slots (:meth:`~dew.models.packed_attention.SharedPromptRows.narrower`: fewer ids to train
    on), its width naming which (:meth:`~dew.models.packed_attention.SharedPromptRows.with_width`).
    """

    def __init__(
        self,
        model,
        seq_len: int,
        beta: float = 0.0,
        pretrained: Variables | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        dual_clip: float | None = 3.0,
        policy_loss: str = "ppo",
        aggregation: str = "token-mean",
        behavior_importance: float | tuple[float, float] | None = None,
        sequence_mask: tuple[float, float] | None = None,
        geometric_mask: tuple[float, float] | None = None,
        sampling_temperature: float | None = None,
        max_token_lag: int | None = None,
        stale_token_weight: float = 0.0,
        proximal: str = "batch",
        layout: SharedPromptRows | None = None,
        ema_decay=_UNSET,
    ):
        if ema_decay is not _UNSET:
            raise ValueError(
                "GRPOObjective keeps its reference in the EMA slot (decay 1 when beta > 0, none otherwise); "
                f"got ema_decay={ema_decay!r}"
            )
        self.model = model
        self.seq_len = check_seq_len(model, seq_len)
        self.beta = number("beta", beta, at_least=0)
        self.pretrained = None if pretrained is None else check_variables(pretrained)
        self.epsilon_low = number("epsilon_low", epsilon_low, at_least=0, at_most=1)
        self.epsilon_high = number("epsilon_high", epsilon_high, at_least=0)
        self.dual_clip = None if dual_clip is None else number("dual_clip", dual_clip, above=1)
        self.policy_loss = policy_loss
        self._surrogate = losses.policy_loss_fn(policy_loss)
        self.aggregation = one_of("aggregation", aggregation, AGGREGATIONS)
        if isinstance(behavior_importance, (tuple, list)):
            self.behavior_importance = band("behavior_importance", behavior_importance, strict=True)
        elif behavior_importance is None:
            self.behavior_importance = None
        else:
            self.behavior_importance = positive("behavior_importance", behavior_importance)
        self.sequence_mask = None if sequence_mask is None else band("sequence_mask", sequence_mask, strict=True)
        self.geometric_mask = None if geometric_mask is None else band("geometric_mask", geometric_mask, strict=True)
        self.sampling_temperature = (
            None if sampling_temperature is None else positive("sampling_temperature", sampling_temperature)
        )
        self.max_token_lag = None if max_token_lag is None else integer("max_token_lag", max_token_lag, at_least=0)
        self.stale_token_weight = number("stale_token_weight", stale_token_weight, at_least=0, below=1,
                                         why="the weight of ids older than max_token_lag: 0 drops them")
        if self.stale_token_weight and self.max_token_lag is None:
            raise ValueError("stale_token_weight needs max_token_lag: the lag past which ids are down-weighted")
        self.proximal = one_of("proximal", proximal, PROXIMAL)
        if layout is not None and layout.width != self.seq_len + 1:
            raise ValueError(f"seq_len + 1 = {self.seq_len + 1} must be the shared-prompt layout's width {layout.width}")
        self.layout = layout
        self.ema_decay = 1.0 if self.beta > 0 else None

    # ----- host checks -----------------------------------------------------------------------

    def validate(self, batch) -> None:
        owner = f"GRPOObjective(seq_len={self.seq_len})"
        width = self.seq_len + 1
        if self.layout is not None and "input_ids" in batch and np.ndim(batch["input_ids"]) == 2:
            width = self.layout.with_width(np.shape(batch["input_ids"])[1]).width  # the slots the batch needs
        rows = None
        if self.max_token_lag is not None and "lags" not in batch:
            raise ValueError(f"{owner}: max_token_lag={self.max_token_lag} needs the batch field 'lags' (each sampled "
                             f"id's updates behind the trained weights, as RolloutScheduler writes it); the batch has "
                             f"{sorted(batch)}")
        for field in REQUIRED + tuple(f for f in ("old_log_probs", "session_index", "lags", "text_prefix_segments")
                                      if f in batch):
            value = require_field(batch, field, owner)
            shape = np.shape(value)
            if len(shape) != 2 or shape[1] != width or (rows is not None and shape[0] != rows):
                raise ValueError(
                    f"{owner}: batch field {field!r} must be [rows, seq_len + 1] = [{rows or 'rows'}, {width}], got {shape}"
                )
            rows = shape[0]
            if field in INTEGER:
                check_integer_field(batch, field, shape, owner)
        if self.aggregation == "session-mean" and "session_index" not in batch:
            raise ValueError(
                f"{owner}: aggregation='session-mean' needs the batch field 'session_index' (the session of each "
                f"sampled id, as pack writes it); the batch has {sorted(batch)}"
            )
        check_vocabulary(batch["input_ids"], self.model, owner, "'input_ids' row")
        response = np.asarray(batch["response_mask"]) != 0
        unprefixed = response & (np.asarray(batch["text_positions"]) == 0)
        unprefixed[:, 0] |= response[:, 0]
        if unprefixed.any():
            row = int(np.argwhere(unprefixed)[0, 0])
            raise ValueError(f"{owner}: row {row} marks a chain's first id as sampled; a sampled id needs a prefix")
        for field in ("behavior_log_probs", "old_log_probs"):
            if field not in batch:
                continue
            values = np.asarray(batch[field], np.float64)
            bad = ~np.isfinite(values) | (response & (values > 1e-6)) | (~response & (values != 0))
            if bad.any():
                row, column = (int(i) for i in np.argwhere(bad)[0])
                raise ValueError(
                    f"{owner}: {field} is missing or misaligned at row {row}, column {column} "
                    f"(value {values[row, column]!r}, response_mask {int(response[row, column])}); "
                    "it must hold a finite log-probability (<= 0) on every sampled id and 0 elsewhere"
                )
        advantages = np.asarray(batch["advantages"], np.float64)
        if not np.isfinite(advantages).all():
            raise ValueError(f"{owner}: advantages holds a non-finite value at row {int(np.argwhere(~np.isfinite(advantages))[0, 0])}")
        if "old_log_probs" not in batch and isinstance(self.behavior_importance, float) and self.proximal == "batch":
            raise ValueError(
                f"{owner}: behavior_importance={self.behavior_importance} (a TIS cap) needs old_log_probs; without them "
                "the loss runs in verl's bypass mode, where the ratio already is current over behaviour and a cap "
                "would count that correction twice"
            )
        if ("support_ids" in batch) != ("support_columns" in batch):
            raise ValueError(f"{owner}: support_ids and support_columns come together")

    # ----- scoring ---------------------------------------------------------------------------

    def packed_log_probs(self, params: Variables, batch) -> jax.Array:
        """log p(id | its chain's prefix) for every id, [rows, width] aligned with input_ids.

        Ids without a prefix in their chain (a chain's first id, padding) get 0. With
        ``sampling_temperature`` the logits are divided by it (after any softcap) and,
        where ``support_ids`` are present, normalised over the sampled id's support only.
        """
        ids, segments = batch["input_ids"], batch["text_segment_ids"]
        prefix = batch.get("text_prefix_segments")
        # A model without shared prefixes (any flax module taking segment ids and positions) is called as before;
        # the prefix and layout keywords go only where a batch or the objective carries them.
        if self.layout is None:
            shared = {} if prefix is None else {"prefix_segments": prefix[:, :-1]}
            logits = self.model.apply(params, ids[:, :-1], segment_ids=segments[:, :-1],
                                      positions=batch["text_positions"][:, :-1], **shared)
        else:  # the whole row keeps the layout's slots; the last id predicts nothing
            layout = self.layout.with_width(ids.shape[1])
            shared = {} if prefix is None else {"prefix_segments": prefix}
            logits = self.model.apply(params, ids, segment_ids=segments, positions=batch["text_positions"],
                                      layout=layout, **shared)[:, :-1]
        if self.sampling_temperature is not None:
            logits = logits / self.sampling_temperature
        scores = token_log_probs(logits, ids[:, 1:])
        if self.sampling_temperature is not None and "support_ids" in batch:
            scores = _support_log_probs(logits, ids, scores, batch["support_ids"], batch["support_columns"])
        valid = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        scores = jnp.where(valid, scores, 0.0)
        return jnp.concatenate([jnp.zeros((ids.shape[0], 1), scores.dtype), scores], axis=1)

    # ----- loss ------------------------------------------------------------------------------

    def loss(self, variables, ema, batch, key):
        rows, width = batch["input_ids"].shape
        current = self.packed_log_probs(variables, batch)[:, 1:]
        mask = (batch["response_mask"][:, 1:] != 0).astype(jnp.float32)
        behavior = batch["behavior_log_probs"][:, 1:]
        advantages = batch["advantages"][:, 1:]
        bypass = "old_log_probs" not in batch and self.proximal == "batch"
        if self.proximal == "current":
            old = jax.lax.stop_gradient(current)
        else:
            old = behavior if bypass else batch["old_log_probs"][:, 1:]
        # Chains: (row, segment) pairs; sessions: session_index remapped to dense ids.
        chain_ids = jnp.where(mask > 0, jnp.arange(rows)[:, None] * (width + 1) + batch["text_segment_ids"][:, 1:], 0)
        chains = rows * (width + 1)
        # The trainer-side policy that corrections compare with behaviour: old, or the detached current one.
        proximal = jax.lax.stop_gradient(current) if bypass else old
        metrics = {f"mismatch/{k}": v for k, v in losses.mismatch_metrics(proximal, behavior, mask).items()}
        trainable = mask.sum()
        weights = jnp.ones_like(mask)

        def removed(name, keep):
            metrics[f"removed/{name}"] = ((mask * (1 - keep)).sum() / jnp.maximum(trainable, 1.0))

        if isinstance(self.behavior_importance, float):
            weights = losses.token_tis_weights(old, behavior, self.behavior_importance)
        elif self.behavior_importance is not None:
            low, high = self.behavior_importance
            if bypass:  # the ratio already is current over behaviour: the band only masks
                keep = losses.token_band_mask(proximal - behavior, mask, low, high)
                removed("behavior_importance", keep)
                mask = mask * keep
            else:
                weights = losses.icepop_weights(old, behavior, low, high)
                removed("behavior_importance", (weights > 0).astype(jnp.float32))
        if "lags" in batch:
            lags = batch["lags"][:, 1:]
            metrics.update({f"lag/share_{name}": share for name, share in losses.lag_shares(lags, mask).items()})
            if self.max_token_lag is not None:
                stale = lags > self.max_token_lag
                if self.stale_token_weight:
                    weights = weights * jnp.where(stale, self.stale_token_weight, 1.0)
                else:
                    keep = (~stale).astype(jnp.float32)
                    removed("max_token_lag", keep)
                    mask = mask * keep
        for name, bounds, mode in (("sequence_mask", self.sequence_mask, "sum"),
                                   ("geometric_mask", self.geometric_mask, "mean")):
            if bounds is not None:
                keep = losses.sequence_mask(proximal - behavior, mask, chain_ids, chains, bounds[0], bounds[1], mode)
                removed(name, keep)
                mask = mask * keep

        per_token, policy_metrics = self._surrogate(losses.SurrogateInputs(
            current, old, advantages, mask, chain_ids, chains, self.epsilon_low, self.epsilon_high, self.dual_clip))
        metrics.update({f"policy/{k}": v for k, v in policy_metrics.items()})
        segments = segment_count = None
        if self.aggregation == "session-mean":
            sessions = jnp.where(mask > 0, batch["session_index"][:, 1:], -1)
            _, dense = jnp.unique(sessions, size=rows * width, fill_value=-1, return_inverse=True)
            segments, segment_count = dense.reshape(sessions.shape), rows * width
        policy = losses.aggregate(per_token * weights, mask, self.aggregation, segments, segment_count)
        loss = policy
        metrics["policy_loss"] = policy
        if self.beta > 0:
            reference = jax.lax.stop_gradient(self.packed_log_probs(ema, batch)[:, 1:])
            kl = losses.aggregate(losses.k3_kl(current, reference), mask, self.aggregation, segments, segment_count)
            metrics["kl"] = kl
            loss = loss + self.beta * kl
        metrics["tokens"] = mask.sum()
        metrics["advantages/mean"] = (batch["advantages"][:, 1:] * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        return loss, metrics

    # ----- validation ------------------------------------------------------------------------

    def evaluate(self, variables, batch):
        owner = f"GRPOObjective(seq_len={self.seq_len}) validation"
        prompt = require_field(batch, "prompt", owner)
        lengths = require_field(batch, "prompt_length", owner)
        width = prompt.shape[1]
        columns = jnp.arange(width)[None, :]
        start = width - lengths[:, None]  # left padding
        real = columns >= start
        positions = jnp.where(real, columns - start, 0)
        logits = self.model.apply(
            variables, prompt[:, :-1], segment_ids=real[:, :-1].astype(jnp.int32), positions=positions[:, :-1]
        )
        scores = token_log_probs(logits, prompt[:, 1:])
        counted = (real[:, 1:] & real[:, :-1]).astype(jnp.float32)
        return {"nll_sum": -(scores * counted).sum(), "prompt_tokens": counted.sum()}

    def summarize(self, totals):
        tokens = totals["prompt_tokens"]
        loss = totals["nll_sum"] / tokens if tokens else float("nan")
        return {"prompt_loss": loss, "prompt_perplexity": float(np.exp(loss)), "prompt_tokens": tokens}


def _support_log_probs(logits, ids, scores, support_ids, support_columns):
    """Scores of sampled ids normalised over their recorded support (columns without one keep ``scores``)."""
    rows, positions, _ = logits.shape
    valid = (support_columns >= 1) & (support_ids >= 0)
    position = jnp.clip(support_columns - 1, 0, positions - 1)  # logits at column - 1 predict the id at column
    values = logits[jnp.arange(rows)[:, None], position, jnp.maximum(support_ids, 0)]
    values = jnp.where(valid, values, -jnp.inf)
    flat = jnp.where(valid, jnp.arange(rows)[:, None] * positions + position, rows * positions)
    count = rows * positions + 1
    peak = jax.ops.segment_max(values.ravel(), flat.ravel(), count)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jax.ops.segment_sum(jnp.where(valid, jnp.exp(values - peak[flat]), 0.0).ravel(), flat.ravel(), count)
    has = total[:-1].reshape(rows, positions) > 0
    log_z = (peak[:-1] + jnp.log(jnp.where(total[:-1] > 0, total[:-1], 1.0))).reshape(rows, positions)
    picked = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(has, picked - log_z, scores)
