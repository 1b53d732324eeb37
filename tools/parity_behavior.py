"""Record verl's behaviour-policy correction weights and the PPO loss they reweight.

Run in the reference environment from the repository root (verl goes in without its
dependencies; tools/requirements-ref.txt says how):

    .venv-ref/bin/python tools/parity_behavior.py

On seeded [N=6, T=10] arrays (response lengths 10, 7, 4, 0, 9 and 1) it runs verl's
compute_rollout_correction_weights on log(pi_old / mu) = old_log_prob - rollout_log_prob:
rollout_is="token" with the threshold 2.0 (token TIS, min(exp(clip(old - mu, -20, 20)), 2),
detached, zero on padding) and with the threshold "0.5_2.0" (IcePop: the same ratio inside
[0.5, 2.0], zero outside). It then passes each set of weights to compute_policy_loss_vanilla
as rollout_is_weights (dual-clip PPO, clip 0.2 / 0.28, clip_ratio_c 3, token-mean and
seq-mean-token-mean) and records the loss and its gradient with respect to log_prob.
Writes tests/fixtures/verl_behavior.npz (versions and configuration in ``meta``, JSON);
tests/test_behavior_losses.py compares dew's functions at 1e-6.
"""

import json
from pathlib import Path

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "verl_behavior.npz"
LENGTHS = [10, 7, 4, 0, 9, 1]
WIDTH = 10
CAP = 2.0
BAND = (0.5, 2.0)
ADVANTAGES = [1.3, -0.7, 0.9, 0.4, -1.6, -0.5]


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20250202)
    rows = len(LENGTHS)
    mask = (np.arange(WIDTH)[None, :] < np.array(LENGTHS)[:, None]).astype(np.float32)
    old = -np.abs(rng.normal(0.0, 1.5, (rows, WIDTH))) - 0.01
    log_prob = old + rng.normal(0.0, 0.3, (rows, WIDTH))
    # Behaviour log-probs spread so that pi_old / mu falls below 0.5, inside the band and above 2.
    rollout = old + rng.normal(0.0, 1.0, (rows, WIDTH)) * np.array([0.1, 0.5, 0.9, 0.3, 0.7, 0.2])[:, None]
    rollout[0, 5] = old[0, 5] + 30.0  # log ratio -30: past the -20 clamp
    rollout[4, 1] = old[4, 1] - 30.0  # log ratio +30: past the +20 clamp
    advantages = np.repeat(np.array(ADVANTAGES)[:, None], WIDTH, axis=1)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return {"log_prob": f32(log_prob), "old_log_prob": f32(old), "rollout_log_prob": f32(rollout),
            "advantages": f32(advantages), "response_mask": mask}


def actor_config(loss_agg_mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_low=0.2,
        clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )


def main() -> None:
    x = inputs()
    mask = torch.tensor(x["response_mask"])
    log_ratio = torch.tensor(x["old_log_prob"]) - torch.tensor(x["rollout_log_prob"])
    meta = {"verl": verl.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "shape": [len(LENGTHS), WIDTH], "lengths": LENGTHS, "cases": {}}
    out: dict[str, np.ndarray] = {f"input.{key}": value for key, value in x.items()}
    for name, threshold in (("tis", CAP), ("icepop", f"{BAND[0]}_{BAND[1]}")):
        weights, metrics = rollout_corr_helper.compute_rollout_correction_weights(log_ratio, mask, "token", threshold)
        assert not weights.requires_grad
        out[f"{name}.weights"] = weights.numpy()
        out[f"{name}.threshold"] = np.array([CAP] if name == "tis" else list(BAND), np.float32)
        print(f"{name:7s} threshold {threshold!s:8s} mean {metrics['rollout_is_mean']:.4f}  "
              f"above {metrics['rollout_is_ratio_fraction_high']:.3f}  "
              f"below {metrics['rollout_is_ratio_fraction_low']:.3f}")
        for agg, label in (("token-mean", "token_mean"), ("seq-mean-token-mean", "session_mean")):
            log_prob = torch.tensor(x["log_prob"], requires_grad=True)
            loss, pg_metrics = core_algos.compute_policy_loss_vanilla(
                old_log_prob=torch.tensor(x["old_log_prob"]), log_prob=log_prob,
                advantages=torch.tensor(x["advantages"]), response_mask=mask, loss_agg_mode=agg,
                config=actor_config(agg), rollout_is_weights=weights,
            )
            loss.backward()
            out[f"{name}.ppo_{label}.loss"] = np.float32(loss.item())
            out[f"{name}.ppo_{label}.grad"] = log_prob.grad.numpy()
            print(f"        ppo {agg:20s} loss {loss.item():+.6f}  clipfrac {pg_metrics['actor/pg_clipfrac']:.3f}")
        meta["cases"][name] = {"function": "compute_rollout_correction_weights", "rollout_is": "token",
                               "rollout_is_threshold": threshold, "loss": "compute_policy_loss_vanilla",
                               "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    np.savez(OUT, meta=np.array([json.dumps(meta, sort_keys=True)]), **out)
    print(f"wrote {OUT.relative_to(OUT.parents[2])}: {len(out)} arrays, "
          f"verl {verl.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
