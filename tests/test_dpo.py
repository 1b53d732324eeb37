"""DPOObjective: TRL parity on fixed tensors, the spec's offline example, the frozen reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.data import Loading, Partition, PreferencePairs
from dew.objectives.dpo import DPOObjective
from dew.losses import dpo_loss, sequence_log_probs

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT.parent / "shared" / "spec" / "post-training.txt"


def test_loss_rewards_and_gradients_equal_trl():
    fixture = np.load(ROOT / "tests" / "fixtures" / "dpo_trl.npz")
    beta, mask = float(fixture["beta"]), jnp.asarray(fixture["completion_mask"], jnp.float32)
    reference = sequence_log_probs(jnp.asarray(fixture["reference_token_log_probs"]), mask)

    def loss_of(token_log_probs):
        return dpo_loss(sequence_log_probs(token_log_probs, mask), reference, beta)

    (loss, metrics), gradient = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(fixture["policy_token_log_probs"]))
    differences = {
        "loss": abs(float(loss) - float(fixture["loss"])),
        "gradient": float(np.abs(np.asarray(gradient) - fixture["gradient"]).max()),
        **{name: abs(float(metrics[f"rewards/{name}"]) - float(fixture[f"rewards_{name}"]))
           for name in ("chosen", "rejected", "margins", "accuracies")},
    }
    print(f"largest differences against TRL {fixture['trl_version']}: "
          + ", ".join(f"{name} {value:.2e}" for name, value in differences.items()))
    assert max(differences.values()) <= 1e-6


@pytest.mark.slow
def test_spec_offline_example_runs_in_a_fresh_process_and_writes_nothing(tmp_path):
    script = ROOT / "examples" / "dpo_offline.py"
    if SPEC.exists():  # the example is the spec's block, verbatim
        lines = SPEC.read_text().split("\n")
        start = next(i for i in range(len(lines)) if lines[i] == "import json" and lines[i + 2] == "import jax")
        end = next(i for i in range(start, len(lines)) if lines[i].startswith('print("Completed"'))
        assert script.read_text() == "\n".join(lines[start : end + 1]) + "\n"
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("Completed 2 DPO updates; reference stayed fixed.")
    assert list(tmp_path.iterdir()) == []


def pairs_data(batch=4):
    rows = [{"chosen": [1, 2, 3, 5], "rejected": [1, 2, 4, 5], "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]},
            {"chosen": [1, 6, 3, 5], "rejected": [1, 6, 4, 5], "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]}]
    return PreferencePairs(records=[json.dumps(r) for r in rows * 2], seq_len=4, loading=Loading(threads=1)).load(batch=batch)


def tiny():
    return models.build("causal_transformer", vocab_size=8, emb_features=16, num_layers=1, num_heads=2,
                        mlp_features=32, max_seq_len=4)


def test_reference_stays_frozen_and_training_prefers_the_chosen_answer():
    objective = DPOObjective(tiny(), seq_len=3, beta=0.5)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), progress=False)
    data = pairs_data()
    start = jax.device_get(trainer.initial_state().params)
    state = trainer.initial_state()
    batch = next(data.train(Partition()))
    state, first = trainer.step(state, batch)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/accuracies"] == 0.0
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6)  # -log sigmoid(0)
    for _ in range(20):
        state, metrics = trainer.step(state, batch)
    assert metrics["rewards/accuracies"] == 1.0 and metrics["rewards/margins"] > 0 and metrics["loss"] < 0.5
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(state.ema), start))


def test_validation_reports_chosen_perplexity():
    objective = DPOObjective(tiny(), seq_len=3)
    variables = jax.jit(objective.init)(jax.random.key(0))
    batch = next(pairs_data().train(Partition()))
    totals = jax.tree.map(float, objective.evaluate(variables, batch))
    # chosen targets counted: positions 2 and 3 of each of the 4 chosen rows
    assert totals["target_tokens"] == 8
    ids = jnp.asarray(batch["input_ids"][:, 0])
    log_probs = jax.nn.log_softmax(tiny().apply(variables, ids[:, :-1]))
    expected = -np.mean([log_probs[row, t, ids[row, t + 1]] for row in range(4) for t in (1, 2)])
    summary = objective.summarize(totals)
    assert summary["chosen_loss"] == pytest.approx(expected, abs=1e-6)
    assert summary["chosen_perplexity"] == pytest.approx(np.exp(expected), rel=1e-6)


def test_bad_options_and_batches_raise():
    with pytest.raises(ValueError, match="ema_decay fixed at 1; got ema_decay=0.99"):
        DPOObjective(tiny(), seq_len=3, ema_decay=0.99)
    with pytest.raises(ValueError, match="beta must be a finite number > 0, got 0"):
        DPOObjective(tiny(), seq_len=3, beta=0)
    objective = DPOObjective(tiny(), seq_len=3)
    batch = next(pairs_data().train(Partition()))
    with pytest.raises(ValueError, match="must be \\[pairs, 2, seq_len \\+ 1\\] = \\[pairs, 2, 4\\], got \\(4, 2, 3\\)"):
        objective.validate({**batch, "input_ids": batch["input_ids"][:, :, :3]})
    with pytest.raises(KeyError, match="needs batch field 'completion_mask'"):
        objective.validate({"input_ids": batch["input_ids"]})
    with pytest.raises(TypeError, match="'input_ids' must hold integers"):
        objective.validate({**batch, "input_ids": batch["input_ids"].astype(np.float32)})
