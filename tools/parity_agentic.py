"""Record verl's policy losses, advantages, KL penalty and bypass-mode masks on fixed arrays.

Run in the reference environment from the repository root (verl goes in without its
dependencies; tools/requirements-ref.txt says how):

    .venv-ref/bin/python tools/parity_agentic.py

Builds seeded [N=6, T=10] arrays (response lengths 10, 7, 4, 0, 9 and 1, so one row
has no response at all; per-row log-ratio scales from 2e-4 to 1 and a few extreme
tokens that reach verl's clamps) and runs verl's own functions on them:
compute_policy_loss_vanilla (token-mean and seq-mean-token-mean), compute_policy_loss_gspo,
compute_policy_loss_cispo, compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo True
and False), compute_rloo_outcome_advantage, kl_penalty(..., "low_var_kl"),
compute_rollout_rejection_mask (token_k1, seq_sum_k1, seq_mean_k1), compute_offpolicy_metrics
and the effective sample size of compute_rollout_correction_weights. Gradients are torch
autograd of each aggregated loss with respect to log_prob. Writes
tests/fixtures/verl_agentic.npz (the versions and each case's configuration in its
``meta`` entry, JSON); tests/test_agentic_losses.py compares dew's losses at 1e-6.

Dew's token band (the behaviour_importance band in bypass mode) bounds the ratio pi/mu, and
verl's k1 statistic is log(mu/pi), so that (low, high) is verl's threshold "1/high_1/low".
Dew's sequence_mask and geometric_mask bound k1 itself, as verl does: their (low, high) is
verl's "low_high" unchanged. Each sequence mode has two asymmetric bands (low * high != 1),
where reading the band as a bound on log(pi/mu) would keep other chains; the fixture
records each band with verl's threshold.
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "verl_agentic.npz"
LENGTHS = [10, 7, 4, 0, 9, 1]
WIDTH = 10
ROW_SCALES = [2e-4, 1e-3, 0.3, 0.5, 1.0, 0.05]  # spread of log_prob - old_log_prob per row
ADVANTAGES = [1.3, -0.7, 0.9, 0.4, -1.6, 0.2]
TOKEN_BAND = (0.5, 1.5)  # keep a token when pi/mu lies in the band
# Keep a sequence when its summed (mean) k1 = log(mu/pi) lies in [log low, log high].
SEQ_SUM_BANDS = {"seq_sum_k1": (0.9, 1.03), "seq_sum_k1_b": (0.98, 1.1)}
SEQ_MEAN_BANDS = {"seq_mean_k1": (0.96, 1.0), "seq_mean_k1_b": (0.99, 1.03)}
ESS_CAP = 2.0


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20250101)
    rows = len(LENGTHS)
    mask = (np.arange(WIDTH)[None, :] < np.array(LENGTHS)[:, None]).astype(np.float32)
    old = -np.abs(rng.normal(0.0, 1.5, (rows, WIDTH))) - 0.01
    log_prob = old + rng.normal(0.0, 1.0, (rows, WIDTH)) * np.array(ROW_SCALES)[:, None]
    log_prob[2, 2] = old[2, 2] + 25.0  # past the +-20 ratio clamp
    log_prob[5, 0] = old[5, 0] + 12.0  # GSPO's sequence log-ratio passes its max=10 clamp
    # (A > 0 on both rows: with A < 0 the clamped GSPO ratio e^10 makes a loss too large to
    # compare at 1e-6 in float32.)
    ref = log_prob + rng.normal(0.0, 0.5, (rows, WIDTH))
    ref[0, 3] = log_prob[0, 3] + 22.0  # low_var_kl: ref - logp clamped at 20, kld at 10
    ref[2, 1] = log_prob[2, 1] - 25.0  # clamped at -20
    ref[1, 4] = log_prob[1, 4] + 5.0  # kld = e^5 - 6 clamped at 10
    rollout_scales = np.array([0.05, 0.4, 0.9, 0.3, 0.2, 0.6])[:, None]
    rollout = log_prob + rng.normal(0.0, 1.0, (rows, WIDTH)) * rollout_scales
    advantages = np.repeat(np.array(ADVANTAGES)[:, None], WIDTH, axis=1)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return {
        "log_prob": f32(log_prob), "old_log_prob": f32(old), "rollout_log_prob": f32(rollout),
        "ref_log_prob": f32(ref), "advantages": f32(advantages), "response_mask": mask,
    }


def actor_config(clip_ratio_low: float, clip_ratio_high: float, loss_mode: str, loss_agg_mode: str) -> ActorConfig:
    # As verl's own tests build one (tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py).
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=3.0,
        loss_agg_mode=loss_agg_mode, policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )


POLICY_CASES = {
    # name: (verl function, loss_mode, clip_ratio_low, clip_ratio_high, loss_agg_mode)
    "ppo_token_mean": (core_algos.compute_policy_loss_vanilla, "vanilla", 0.2, 0.28, "token-mean"),
    "ppo_session_mean": (core_algos.compute_policy_loss_vanilla, "vanilla", 0.2, 0.28, "seq-mean-token-mean"),
    # GSPO paper / verl GSPO recipe: clip 3e-4 / 4e-4 on the sequence ratio, seq-mean-token-mean.
    "gspo": (core_algos.compute_policy_loss_gspo, "gspo", 3e-4, 4e-4, "seq-mean-token-mean"),
    "cispo": (core_algos.compute_policy_loss_cispo, "cispo", 0.2, 0.28, "token-mean"),
    # MiniMax-M1: no lower bound on the IS weight (a large epsilon_low), only epsilon_high tuned.
    "cispo_no_low": (core_algos.compute_policy_loss_cispo, "cispo", 10.0, 0.28, "token-mean"),
}


def policy_cases(x: dict[str, np.ndarray], out: dict, meta: dict) -> None:
    for name, (function, loss_mode, low, high, agg) in POLICY_CASES.items():
        log_prob = torch.tensor(x["log_prob"], requires_grad=True)
        loss, metrics = function(
            old_log_prob=torch.tensor(x["old_log_prob"]), log_prob=log_prob,
            advantages=torch.tensor(x["advantages"]), response_mask=torch.tensor(x["response_mask"]),
            loss_agg_mode=agg, config=actor_config(low, high, loss_mode, agg),
        )
        loss.backward()
        out[f"{name}.loss"] = np.float32(loss.item())
        out[f"{name}.grad"] = log_prob.grad.numpy()
        for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            out[f"{name}.{key}"] = np.float32(metrics[f"actor/{key}"])
        meta["cases"][name] = {"function": function.__name__, "clip_ratio_low": low, "clip_ratio_high": high,
                               "clip_ratio_c": 3.0, "loss_agg_mode": agg}
        print(f"{name:18s} loss {loss.item():+.6f}  clipfrac {metrics['actor/pg_clipfrac']:.3f}  "
              f"ppo_kl {metrics['actor/ppo_kl']:+.4f}  clipfrac_lower {metrics['actor/pg_clipfrac_lower']:.3f}")


def advantage_cases(out: dict, meta: dict) -> None:
    # Groups of 4, 3, 2 (equal rewards), 1 and 2, in an interleaved order; keys are not contiguous.
    index = np.array([7, 3, 7, 11, 3, 7, 3, 5, 7, 9, 5, 9])
    scores = np.array([1.0, 0.0, 0.0, 0.7, 1.0, 1.0, 0.25, 0.5, 0.5, -1.0, 0.5, 2.0], np.float32)
    out["advantage.index"], out["advantage.scores"] = index, scores
    # The score sits in a [S, 1] token_level_rewards with a full response mask, so each
    # output row holds exactly the sample's advantage.
    rewards, mask = torch.tensor(scores)[:, None], torch.ones(len(scores), 1)
    for name, call in {
        "grpo_group": lambda: core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index,
                                                                        norm_adv_by_std_in_grpo=True),
        "grpo_mean": lambda: core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index,
                                                                       norm_adv_by_std_in_grpo=False),
        "rloo": lambda: core_algos.compute_rloo_outcome_advantage(rewards.clone(), mask, index),
    }.items():
        advantages, _ = call()
        out[f"advantage.{name}"] = advantages[:, 0].numpy()
        print(f"advantage {name:10s}", np.array2string(advantages[:, 0].numpy(), precision=4, max_line_width=200))
    meta["cases"]["advantage"] = {"functions": ["compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage"],
                                  "epsilon": 1e-6, "group_sizes": {"7": 4, "3": 3, "5": 2, "11": 1, "9": 2}}


def kl_case(x: dict[str, np.ndarray], out: dict, meta: dict) -> None:
    log_prob = torch.tensor(x["log_prob"], requires_grad=True)
    kld = core_algos.kl_penalty(log_prob, torch.tensor(x["ref_log_prob"]), "low_var_kl")
    loss = core_algos.agg_loss(kld, torch.tensor(x["response_mask"]), "token-mean")
    loss.backward()
    out["k3.kl"], out["k3.loss"], out["k3.grad"] = kld.detach().numpy(), np.float32(loss.item()), log_prob.grad.numpy()
    meta["cases"]["k3"] = {"function": "kl_penalty", "kl_penalty": "low_var_kl", "loss": "agg_loss token-mean"}
    print(f"k3 low_var_kl token-mean {loss.item():.6f}")


def bypass_cases(x: dict[str, np.ndarray], out: dict, meta: dict) -> None:
    # Bypass mode: old_log_prob is the rollout's, and the masks compare the detached
    # current policy with it (compute_policy_loss_bypass_mode).
    log_ratio = torch.tensor(x["log_prob"]) - torch.tensor(x["rollout_log_prob"])
    mask = torch.tensor(x["response_mask"])
    cases = [("token_k1", "token_k1", TOKEN_BAND, f"{1.0 / TOKEN_BAND[1]}_{1.0 / TOKEN_BAND[0]}")]
    cases += [(name, "seq_sum_k1", band, f"{band[0]}_{band[1]}") for name, band in SEQ_SUM_BANDS.items()]
    cases += [(name, "seq_mean_k1", band, f"{band[0]}_{band[1]}") for name, band in SEQ_MEAN_BANDS.items()]
    for name, option, (low, high), threshold in cases:
        keep, _ = rollout_corr_helper.compute_rollout_rejection_mask(log_ratio, mask, option, threshold)
        out[f"rs.{name}"], out[f"rs.{name}.band"] = keep.numpy(), np.array([low, high], np.float32)
        meta["cases"][f"rs.{name}"] = {"rollout_rs": option, "rollout_rs_threshold": threshold,
                                       "dew_band": [low, high]}
        print(f"rejection {name:16s} threshold {threshold:>24s}  kept {int(keep.sum())}/{int(mask.sum())} tokens")
    old, rollout = torch.tensor(x["old_log_prob"]), torch.tensor(x["rollout_log_prob"])
    metrics = rollout_corr_helper.compute_offpolicy_metrics(old, rollout, mask)
    out["mismatch.kl"], out["mismatch.k3_kl"] = np.float32(metrics["kl"]), np.float32(metrics["k3_kl"])
    for name, cap in (("ess", ESS_CAP), ("ess_uncapped", math.inf)):
        _, is_metrics = rollout_corr_helper.compute_rollout_correction_weights(old - rollout, mask, "token", cap)
        out[f"mismatch.{name}"] = np.float32(is_metrics["rollout_is_eff_sample_size"])
    out["mismatch.ess_cap"] = np.float32(ESS_CAP)
    meta["cases"]["mismatch"] = {"kl, k3_kl": "compute_offpolicy_metrics(old_log_prob, rollout_log_prob)",
                                 "ess": f"compute_rollout_correction_weights token, threshold {ESS_CAP} "
                                        "(ess_uncapped: threshold inf), rollout_is_eff_sample_size"}
    print(f"mismatch kl {metrics['kl']:+.5f}  k3_kl {metrics['k3_kl']:.5f}  ess {float(out['mismatch.ess']):.5f}  "
          f"ess_uncapped {float(out['mismatch.ess_uncapped']):.5f}")


def main() -> None:
    torch.manual_seed(0)
    x = inputs()
    meta = {"verl": verl.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "shape": [len(LENGTHS), WIDTH], "lengths": LENGTHS, "cases": {}}
    out: dict[str, np.ndarray] = {f"input.{key}": value for key, value in x.items()}
    policy_cases(x, out, meta)
    advantage_cases(out, meta)
    kl_case(x, out, meta)
    bypass_cases(x, out, meta)
    np.savez(OUT, meta=np.array([json.dumps(meta, sort_keys=True)]), **out)
    print(f"wrote {OUT.relative_to(OUT.parents[2])}: {len(out)} arrays, "
          f"verl {verl.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
