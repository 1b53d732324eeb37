"""``dew-ray sft``, ``dew-ray dpo`` and ``dew-ray grpo`` on a Hugging Face model directory and data files.

The model directory is a tiny Qwen3-shaped decoder saved with ``Pretrained.save`` beside the
built-in story tokenizer (with its chat template) saved with ``save_pretrained``: what a user
has after downloading a model, made offline. Each stage runs as a real ``dew-ray`` process.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from tracker_files import tensorboard_scalars

from dew.config import ConfigError, load_config
from dew.models.pretrained import load_pretrained
from dew.recipes.stage_files import StageRun


def write_model(directory):
    from dew.data.stories import story_tokenizer
    from dew.models.named_shapes import tiny_qwen3
    from dew.models.pretrained import Pretrained

    tokenizer = story_tokenizer()
    model = tiny_qwen3(vocab_size=len(tokenizer))
    Pretrained.from_model(model).save(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)), directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_data(folder):
    stories = ("Tom had a red ball.", "Sue saw a big dog.", "The cat ran home.", "Ben liked the sun.")
    chat = write_jsonl(folder / "chat.jsonl", [{"messages": [{"role": "user", "content": "Tell me a story."},
                                                             {"role": "assistant", "content": s}]} for s in stories])
    pairs = write_jsonl(folder / "pairs.jsonl", [{"prompt": "Tom had", "chosen": " a ball.", "rejected": " ball ball."}] * 4)
    prompts = write_jsonl(folder / "prompts.jsonl", [{"prompt": s[:8], "data_source": "stories", "ground_truth": "1"}
                                                     for s in stories])
    return chat, pairs, prompts


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stage-cli")
    return write_model(folder / "model"), *write_data(folder)


def dew_ray(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "dew_ray.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def leaves(directory):
    return [np.asarray(x) for x in jax.tree.leaves(load_pretrained(directory)[1])]


@pytest.mark.slow
def test_sft_then_dpo_then_grpo_from_the_command_line(files, tmp_path):
    model, chat, pairs, prompts = files
    start = str(model)
    for kind, data, extra in (("sft", chat, ["--set", "seq_len=63"]), ("dpo", pairs, ["--set", "seq_len=16"]),
                              ("grpo", prompts, ["--set", "reward=math", "--set", "max_prompt_len=8",
                                                 "--set", "max_new_tokens=4", "--set", "groups=2"])):
        out = tmp_path / kind
        result = dew_ray(kind, "--model", start, "--data", str(data), "--output-dir", str(out), "--steps", "2",
                         "--set", "batch=2", "--set", "learning_rate=1e-2", "--set", "trackers=tensorboard", *extra)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"{kind}: 2 updates" in result.stdout
        assert "PyTorch was not found" not in result.stderr  # transformers' advisory reads as fatal; dew silences it
        rows = [json.loads(line) for line in (out / kind / "metrics.jsonl").read_text().splitlines()]
        events = tensorboard_scalars(out / kind / "tensorboard")["train/loss"]
        assert events == [(row["step"], pytest.approx(row["loss"])) for row in rows if row["kind"] == "train"]
        assert any((out / kind).glob("*/")), "no checkpoint directory"
        assert any(not np.array_equal(a, b) for a, b in zip(leaves(out / "policy"), leaves(start), strict=True))
        start = str(out / "policy")  # the next stage starts from this one's exported policy
    metrics = (tmp_path / "grpo" / "grpo" / "metrics.jsonl").read_text()
    for row in (json.loads(line) for line in metrics.splitlines()):  # a GRPO run logs what it is judged by
        if row["kind"] == "train":
            assert row["rollout/reward/source/stories"] == row["rollout/reward/mean"]
            assert {"rollout/reward/std", "rollout/reward/equal_group_share", "rollout/response/length_mean",
                    "rollout/response/length_max", "rollout/response/truncated_share"} <= set(row)
            assert 0 < row["rollout/response/length_mean"] <= row["rollout/response/length_max"] <= 4
    again = dew_ray("grpo", "--model", str(tmp_path / "dpo" / "policy"), "--data", str(prompts), "--output-dir",
                    str(tmp_path / "grpo"), "--steps", "2", "--set", "batch=2", "--set", "reward=math",
                    "--set", "max_prompt_len=8", "--set", "max_new_tokens=4", "--set", "groups=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "grpo" / "grpo" / "metrics.jsonl").read_text() == metrics  # restored: nothing trained again


def test_a_bad_stage_fails_with_the_field_named(files, tmp_path):
    model, chat, pairs, prompts = files
    result = dew_ray("grpo", "--model", str(model), "--data", str(prompts), "--output-dir", str(tmp_path / "g"),
                     "--steps", "1")
    assert result.returncode == 2 and "config field 'reward'" in result.stderr, result.stderr[-2000:]
    result = dew_ray("sft", "--model", str(model), "--data", str(tmp_path / "missing.jsonl"), "--steps", "1",
                     "--output-dir", str(tmp_path / "s"))
    assert result.returncode == 2 and "missing.jsonl does not exist" in result.stderr, result.stderr[-2000:]
    result = dew_ray("grpo", "--model", str(model), "--data", str(prompts), "--output-dir", str(tmp_path / "g"),
                     "--steps", "1", "--set", "reward=math", "--set", "max_prompt_len=8", "--set", "max_new_tokens=300")
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("a grpo stage's rows of 308 ids (max_prompt_len=8 + max_new_tokens=300) exceed the model's context, "
            f"max_position_embeddings=256 in {model / 'config.json'}") in result.stderr, result.stderr[-2000:]


def test_every_command_lists_its_config_fields_in_help():
    for command, lines in (("grpo", ["  reward (str | None, default None)", "  max_new_tokens (int, default 16, >= 1)",
                                     "      GRPO's response budget", "  max_prompt_len (int, default 64, >= 1)"]),
                           ("rlvr", ["  model (str | None, default None)",
                                     "  max_prompt_length (int | None, default None, >= 1)",
                                     "  reward (str, default 'verifiable')", "  temperature (float, default 1.0, > 0)"]),
                           ("chain", ["  stages (list[StageSpec], required, length >= 1)"])):
        result = dew_ray(command, "--help", timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        for line in lines:
            assert line in result.stdout, (command, line, result.stdout[-3000:])


def test_stage_configs_read_toml_tables_and_overrides(tmp_path):
    path = tmp_path / "sft.toml"
    path.write_text('[sft]\nmodel = "m"\ndata = "d.jsonl"\nsteps = 3\nlearning_rate = 2e-5\n')
    config = load_config(StageRun, path, ["batch=4"], table="sft")
    assert (config.steps, config.batch, config.learning_rate, config.seq_len) == (3, 4, 2e-5, 255)
    with pytest.raises(ConfigError, match="config field 'groups' must be an integer >= 2, got 1"):
        load_config(StageRun, path, ["groups=1"], table="sft")


def test_a_grpo_stage_takes_the_pipelines_verifiable_routes():
    from dew.data.verifiable import CODE_SOURCE, verifiable_tasks
    from dew.recipes.stage_files import load_reward

    reward = load_reward("verifiable")
    assert reward("openai/gsm8k", "so #### 72", "72", "{}") == 1.0 and reward("openai/gsm8k", "72", "72", "{}") == 0.0
    (code,) = [task for task in verifiable_tasks(4, seed=0) if task.data_source == CODE_SOURCE][:1]
    assert reward(CODE_SOURCE, code.answer, code.ground_truth, "{}") == 1.0  # its program ran in the sandbox
    with pytest.raises(ValueError, match="no reward for data_source 'quiz'; known: \\['DigitalLearningGmbH"):
        reward("quiz", "x", "y", "{}")
    with pytest.raises(ValueError, match="needs config field 'reward': \"math\", \"verifiable\""):
        load_reward(None)


def test_stages_take_dtype_warm_up_and_the_thinking_switch(tmp_path, qwen3_gsm8k):
    import jax.numpy as jnp
    import optax

    from dew.recipes.run_inputs import model_tokenizer
    from dew.recipes.stage_files import stage_of

    model_dir, parquet, _ = qwen3_gsm8k
    config = load_config(StageRun, None, [f"model={model_dir}", f"data={parquet}", "steps=4", "dtype=bfloat16",
                                          "warmup_steps=10", "learning_rate=1e-4", "enable_thinking=false",
                                          "reward=verifiable"])
    model, variables = config.load_model()
    assert model.dtype == jnp.bfloat16 and variables["params"]["norm"]["scale"].dtype == jnp.float32
    assert config.load_model(weights=False)[1] is None
    optimizer = config.optimizer()  # AdamW rising from 0 to learning_rate over warmup_steps
    state = optimizer.init({"w": jnp.ones(())})
    steps = []
    for _ in range(12):
        update, state = optimizer.update({"w": jnp.ones(())}, state, {"w": jnp.ones(())})
        steps.append(float(-update["w"]))
    assert steps[0] == 0 and steps[5] < steps[9] and steps[10] == pytest.approx(steps[11])
    assert isinstance(optimizer, optax.GradientTransformation)
    stage = stage_of(config, "grpo", "grpo", model_tokenizer(model_dir))
    assert stage.data.template_options == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="cannot read 'float16' as config field 'dtype' \\(one of 'float32'"):
        load_config(StageRun, None, [f"model={model_dir}", f"data={parquet}", "steps=1", "dtype=float16"])
