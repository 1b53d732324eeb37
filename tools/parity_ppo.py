"""Record verl's GAE, clipped policy and value losses and the composite PPO loss's autograd gradients.

Run in the reference environment from the repository root (verl goes in without its
dependencies; tools/requirements-ref.txt says how):

    .venv-ref/bin/python tools/parity_ppo.py

verl is the 0.9.1 wheel from PyPI; the spec names revision d040717b21af2e23e8e789a3e354cff2394ae2de,
which is not installable here, and ``meta`` records what ran. The arrays are seeded
[N=4, T=12] action sequences: episode lengths 12, 9, 5 and 7, with observation gaps
(mask 0 between sampled ids, as tool turns leave them) in two rows, rewards on each
episode's last action. A linear policy (``features @ W``, log-softmax, the sampled ids'
log-probabilities) and a linear critic (``features @ w``) make the parameters whose
gradients are recorded. verl's functions, token-mean throughout:

- ``compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)``
  (advantages whitened by ``masked_whiten``, and returns);
- ``compute_policy_loss_vanilla`` (clip 0.2 / 0.28, dual clip 3) on those advantages;
- ``compute_value_loss(vpreds, returns, values, response_mask, cliprange_value=0.2)``;
- ``kl_penalty(..., "low_var_kl")`` aggregated by token mean;
- the composite ``pg_loss + 0.5 * vf_loss + 0.03 * kl`` and ``torch.autograd`` of it with
  respect to W and w.

Writes tests/fixtures/verl_ppo.npz; tests/test_ppo.py compares dew at 1e-6.
"""

import json
from pathlib import Path

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "verl_ppo.npz"
ROWS, WIDTH, FEATURES, VOCAB = 4, 12, 6, 10
GAMMA, LAM, VALUE_CLIP, VALUE_COEFFICIENT, BETA = 0.97, 0.9, 0.2, 0.5, 0.03
CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20251201)
    mask = np.zeros((ROWS, WIDTH), np.float32)
    for row, length in enumerate([12, 9, 5, 7]):
        mask[row, :length] = 1.0
    mask[0, 4:6] = 0.0  # a tool's observation between two calls
    mask[1, 2] = 0.0
    rewards = np.zeros((ROWS, WIDTH), np.float32)
    for row in range(ROWS):
        rewards[row, np.nonzero(mask[row])[0][-1]] = [1.0, 0.0, 1.0, -0.5][row]  # on the last action
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    features = f32(rng.normal(0.0, 1.0, (ROWS, WIDTH, FEATURES)))
    policy_weights = f32(rng.normal(0.0, 0.5, (FEATURES, VOCAB)))
    critic_weights = f32(rng.normal(0.0, 0.3, (FEATURES,)))
    actions = rng.integers(0, VOCAB, (ROWS, WIDTH))
    logits = features @ policy_weights
    log_prob = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    current = np.take_along_axis(log_prob, actions[..., None], -1)[..., 0]
    old = current + rng.normal(0.0, 0.3, (ROWS, WIDTH))  # a few tokens land outside the clip range
    ref = current + rng.normal(0.0, 0.2, (ROWS, WIDTH))
    values = features @ critic_weights + rng.normal(0.0, 0.3, (ROWS, WIDTH))  # the recorded (old) values
    return {"mask": mask, "rewards": rewards, "features": features, "policy_weights": policy_weights,
            "critic_weights": critic_weights, "actions": actions.astype(np.int32), "old_log_prob": f32(old),
            "ref_log_prob": f32(ref), "values": f32(values * mask)}


def main() -> None:
    x = inputs()
    t = {k: torch.tensor(v) for k, v in x.items()}
    mask = t["mask"]
    advantages, returns = core_algos.compute_gae_advantage_return(t["rewards"], t["values"], mask, GAMMA, LAM)
    weights = t["policy_weights"].clone().requires_grad_(True)
    critic = t["critic_weights"].clone().requires_grad_(True)
    log_prob = torch.log_softmax(t["features"] @ weights, -1).gather(-1, t["actions"].long()[..., None])[..., 0]
    vpreds = t["features"] @ critic
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                         clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=DUAL_CLIP,
                         loss_agg_mode="token-mean", policy_loss=PolicyLossConfig(loss_mode="vanilla"))
    pg_loss, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=t["old_log_prob"], log_prob=log_prob, advantages=advantages, response_mask=mask,
        loss_agg_mode="token-mean", config=config)
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(vpreds, returns, t["values"], mask, VALUE_CLIP,
                                                         loss_agg_mode="token-mean")
    kl = core_algos.agg_loss(core_algos.kl_penalty(log_prob, t["ref_log_prob"], "low_var_kl"), mask, "token-mean")
    composite = pg_loss + VALUE_COEFFICIENT * vf_loss + BETA * kl
    composite.backward()
    out = {**x, "advantages": advantages.numpy(), "returns": returns.numpy(), "pg_loss": np.float32(pg_loss.item()),
           "vf_loss": np.float32(vf_loss.item()), "vf_clipfrac": np.float32(float(vf_clipfrac)),
           "kl": np.float32(kl.item()), "composite": np.float32(composite.item()),
           "grad_policy": weights.grad.numpy(), "grad_critic": critic.grad.numpy()}
    meta = {"verl": verl.__version__, "torch": torch.__version__,
            "revision": "verl 0.9.1 from PyPI: the spec's d040717b21af2e23e8e789a3e354cff2394ae2de is not installable "
                        "here (no network beyond the package registries, and no wheel of that commit)",
            "gamma": GAMMA, "lam": LAM, "value_clip": VALUE_CLIP, "value_coefficient": VALUE_COEFFICIENT,
            "beta": BETA, "clip_ratio_low": CLIP_LOW, "clip_ratio_high": CLIP_HIGH, "clip_ratio_c": DUAL_CLIP,
            "functions": ["compute_gae_advantage_return", "compute_policy_loss_vanilla", "compute_value_loss",
                          "kl_penalty(low_var_kl)", "agg_loss(token-mean)"]}
    out["meta"] = np.array(json.dumps(meta))
    np.savez(OUT, **out)
    print(f"wrote {OUT.name} with verl {verl.__version__}: pg {pg_loss.item():+.6f}, vf {vf_loss.item():.6f} "
          f"(clipfrac {float(vf_clipfrac):.3f}), kl {kl.item():.6f}, composite {composite.item():+.6f}")


if __name__ == "__main__":
    main()
