"""The Ray chain (dew_ray.pipelines.chain) end to end: ``dew-ray chain --config`` on a model directory, and a rerun."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import ROOT, free_port, import_from, wait_for_job_agent
from test_stage_cli import write_data, write_model

from dew.config import ConfigError, load_config
from dew.models.pretrained import load_pretrained
from dew.recipes.stage_chain import stage_trainer
from dew.recipes.run_inputs import model_tokenizer
from dew.recipes.stage_files import stage_of
from dew_ray.pipelines.chain import ChainConfig
from tracker_files import tensorboard_scalars


def chain_file(folder, model, chat, pairs, prompts):
    path = folder / "chain.toml"
    path.write_text(f'''
model = "{model}"
run_dir = "{folder / 'run'}"
batch = 2
learning_rate = 1e-2
checkpoint_every = 2
progress = false
trackers = ["tensorboard"]

[[stages]]
name = "warm"
kind = "sft"
data = "{chat}"
steps = 3
seq_len = 63

[[stages]]
name = "prefer"
kind = "dpo"
data = "{pairs}"
steps = 2
seq_len = 16
beta = 0.2

[[stages]]
name = "reinforce"
kind = "grpo"
data = "{prompts}"
steps = 2
reward = "math"
max_prompt_len = 8
max_new_tokens = 4
groups = 2
''')
    return path


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.ray
@pytest.mark.slow
def test_dew_ray_chain_trains_each_stage_from_the_last_and_a_rerun_restores(tmp_path):
    model = write_model(tmp_path / "model")
    config = chain_file(tmp_path, model, *write_data(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "dew_ray.cli", "chain", "--config", str(config)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert [(s["name"], s["kind"], s["restored"]) for s in summary["stages"]] == [
        ("warm", "sft", False), ("prefer", "dpo", False), ("reinforce", "grpo", False)]
    policies = {name: leaves(load_pretrained(run / name / "policy")[1]) for name in ("warm", "prefer", "reinforce")}
    start = leaves(load_pretrained(model)[1])
    for earlier, later in ((start, policies["warm"]), (policies["warm"], policies["prefer"]),
                           (policies["prefer"], policies["reinforce"])):
        assert any(not np.array_equal(a, b) for a, b in zip(earlier, later, strict=True))
    assert [json.loads(line)["step"] for line in (run / "warm" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    losses = [json.loads(line)["loss"] for line in (run / "warm" / "metrics.jsonl").read_text().splitlines()]
    events = tensorboard_scalars(run / "warm" / "tensorboard")["train/loss"]
    assert [step for step, _ in events] == [1, 2, 3] and [loss for _, loss in events] == pytest.approx(losses)
    # the DPO stage's frozen reference is the SFT stage's final policy (it came through the object store)
    spec = ChainConfig(**load_config(ChainConfig, config).model_dump()).stages[1]
    tokenizer = model_tokenizer(str(model), None)
    decoder, _ = load_pretrained(model)
    trainer, _ = stage_trainer(decoder, optax.adamw(1e-2), jax.random.key(0), run / "prefer", 2,
                               stage_of(spec, "dpo", "prefer", tokenizer), load_pretrained(run / "warm" / "policy")[1])
    state, _ = trainer.restore(run / "prefer")
    for a, b in zip(leaves(state.ema), policies["warm"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 2
    lines = {name: (run / name / "metrics.jsonl").read_text() for name in ("warm", "prefer", "reinforce")}
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert [s["restored"] for s in summary["stages"]] == [True, True, True]
    assert lines == {name: (run / name / "metrics.jsonl").read_text() for name in lines}
    assert [step for step, _ in tensorboard_scalars(run / "prefer" / "tensorboard")["train/loss"]] == [1, 2]
    for name, before in policies.items():
        for a, b in zip(before, leaves(load_pretrained(run / name / "policy")[1]), strict=True):
            np.testing.assert_array_equal(a, b)


def test_chain_configs_are_checked_by_the_shared_loader(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "m"\n[[stages]]\nname = "a"\nkind = "sft"\ndata = "x"\nsteps = 1\n'
                    '[[stages]]\nname = "a"\nkind = "dpo"\ndata = "y"\nsteps = 1\n')
    with pytest.raises(ConfigError, match="must differ"):
        load_config(ChainConfig, path)
    path.write_text('model = "m"\n[[stages]]\nname = "a"\nkind = "ppo"\ndata = "x"\nsteps = 1\n')
    with pytest.raises(ConfigError, match="config field 'stages.0': config field 'kind' must be one of"):
        load_config(ChainConfig, path)
    path.write_text('model = "m"\n[[stages]]\nname = "a"\nkind = "sft"\ndata = "x"\nsteps = 1\n')
    assert load_config(ChainConfig, path, ["batch=4"]).stages[0].kind == "sft"


@pytest.mark.ray
@pytest.mark.slow
def test_the_chain_runs_as_a_submitted_ray_job(tmp_path):
    """``ray start --head`` and ``ray job submit -- python -m dew_ray.pipelines.chain``, as docs/chains.md says, with
    two trainer processes per stage."""
    model = write_model(tmp_path / "model")
    config = chain_file(tmp_path, model, *write_data(tmp_path))
    temp_dir, dashboard, port = f"/tmp/dew-chain-head-{free_port()}", free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    env["RAY_AUTH_MODE"] = "token"  # conftest made Ray's token (token_auth)
    lines = [f"uv run ray start --head --num-cpus 2 --port {port} --dashboard-port {dashboard} "
             f"--dashboard-agent-listen-port 0 --temp-dir {temp_dir}",
             f"uv run ray job submit --address http://127.0.0.1:{dashboard} --working-dir . -- "
             f"python -m dew_ray.pipelines.chain --config {config} --set run_dir={tmp_path / 'submitted'} "
             "--set trainers=2 --set trainer_cpus=0.5"]  # each stage a two-process jax.distributed group
    try:
        started = subprocess.run(["bash", "-ec", lines[0]], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=300)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        wait_for_job_agent(f"http://127.0.0.1:{dashboard}")
        ran = subprocess.run(["bash", "-ec", lines[1]], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=900)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        assert "succeeded" in ran.stdout.lower()
        summary = json.loads((tmp_path / "submitted" / "summary.json").read_text())
        assert [stage["name"] for stage in summary["stages"]] == ["warm", "prefer", "reinforce"]
        assert (tmp_path / "submitted" / "reinforce" / "policy" / "model.safetensors").exists()
    finally:
        import_from("bench", "processes").stop_ray_head(temp_dir, port)
