"""Record TRL's DPO loss, rewards and gradients on fixed per-token log-probabilities.

Run in the reference environment (tools/requirements-ref.txt), from the repository root:

    .venv-ref/bin/python tools/parity_dpo.py

Runs TRL's own DPOTrainer._compute_loss (TRL 1.16, loss_type "sigmoid", reverse KL)
with stand-ins for the policy and reference models that return fixed per-token
log-probabilities (what TRL's fused LM head returns for masked labels: the target's
log-probability on completion tokens, 0 elsewhere), and records the loss, TRL's
logged rewards and the gradient of the loss with respect to the policy's per-token
log-probabilities. Writes tests/fixtures/dpo_trl.npz; tests/test_dpo.py compares
dew's dpo_loss at 1e-6.
"""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import trl
from trl.trainer.dpo_trainer import DPOTrainer

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "dpo_trl.npz"
PAIRS, WIDTH, BETA = 6, 9, 0.1


class FixedModel:
    """Returns fixed per-token log-probabilities for the [chosen; rejected] batch TRL builds."""

    def __init__(self, log_probs):
        self.log_probs, self.training, self.is_gradient_checkpointing = log_probs, True, False

    def __call__(self, input_ids, labels, **kwargs):
        mask = (labels[:, 1:] != -100).to(self.log_probs.dtype)
        rows, width = self.log_probs.shape
        zeros = torch.zeros(rows, width)
        return SimpleNamespace(
            log_probs=self.log_probs * mask, entropy=zeros, mean_logits=zeros,
            is_top1=torch.zeros(rows, width, dtype=torch.bool), aux_loss=None,
        )


class Gather:
    def gather_for_metrics(self, x):
        return x

    def gather(self, x):
        return x

    device = torch.device("cpu")


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    completion_mask = torch.zeros(2 * PAIRS, WIDTH + 1, dtype=torch.long)
    for row in range(2 * PAIRS):
        prompt = int(torch.randint(1, 4, (1,), generator=generator))
        answer = int(torch.randint(1, WIDTH + 1 - prompt, (1,), generator=generator))
        completion_mask[row, prompt : prompt + answer] = 1
    policy = (-torch.rand(2 * PAIRS, WIDTH, generator=generator, dtype=torch.float64) * 3).float().requires_grad_()
    reference = (-torch.rand(2 * PAIRS, WIDTH, generator=generator, dtype=torch.float64) * 3).float()
    input_ids = torch.randint(0, 50, (2 * PAIRS, WIDTH + 1), generator=generator)
    stub = SimpleNamespace(
        model=FixedModel(policy), ref_model=FixedModel(reference), accelerator=Gather(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=["sigmoid"],
        loss_weights=[1.0], beta=BETA, use_weighting=False, _metrics={"train": _Metrics()}, _total_train_tokens=0, _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion_mask}
    loss = DPOTrainer._compute_loss(stub, stub.model, inputs, return_outputs=False)
    loss.backward()
    metrics = stub._metrics["train"]
    # TRL's batch is [all chosen; all rejected]; dew's is [pairs, 2, ...].
    to_pairs = lambda t: t.detach().numpy().reshape(2, PAIRS, -1).transpose(1, 0, 2)  # noqa: E731
    np.savez(
        OUT, beta=np.float32(BETA), policy_token_log_probs=to_pairs(policy),
        reference_token_log_probs=to_pairs(reference), completion_mask=to_pairs(completion_mask)[:, :, 1:],
        loss=np.float32(loss.item()), gradient=to_pairs(policy.grad),
        rewards_chosen=np.float32(metrics["rewards/chosen"][0]), rewards_rejected=np.float32(metrics["rewards/rejected"][0]),
        rewards_margins=np.float32(metrics["rewards/margins"][0]),
        rewards_accuracies=np.float32(metrics["rewards/accuracies"][0]),
        trl_version=np.str_(trl.__version__), torch_version=np.str_(torch.__version__),
    )
    print(f"wrote {OUT}: loss {loss.item():.6f}, TRL {trl.__version__}")


class _Metrics(dict):
    def __missing__(self, key):
        self[key] = []
        return self[key]


if __name__ == "__main__":
    main()
