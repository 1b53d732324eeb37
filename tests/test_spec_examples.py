"""The spec's code blocks run as written, after the TinyStories stand-in prelude (PPO's from a checkout)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import ROOT, import_from

SPEC = ROOT.parent / "shared" / "spec" / "post-training.txt"
BLOCKS = ROOT / "examples" / "spec"


def spec_block(first_line: str, last_line_prefix: str) -> str:
    lines = SPEC.read_text().split("\n")
    start = lines.index(first_line)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(last_line_prefix))
    return "\n".join(lines[start : end + 1]) + "\n"


@pytest.mark.skipif(not SPEC.exists(), reason="the spec is not beside this checkout (../shared/spec)")
def test_blocks_are_the_spec_verbatim():
    assert (BLOCKS / "sft.py").read_text() == spec_block("import itertools", ").fit(sft_data")
    lines = SPEC.read_text().split("\n")
    start = lines.index("from dew.data import PreferencePairs") - 2
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("    pairs, steps=10, log_every=5)"))
    assert (BLOCKS / "dpo.py").read_text() == "\n".join(lines[start : end + 1]) + "\n"
    grpo = spec_block("from dew.objectives.rl import GRPOObjective, SampledRollout", ").fit(rl_data, steps=20")
    assert (BLOCKS / "grpo.py").read_text() == grpo
    assert (BLOCKS / "ppo.py").read_text() == ppo_block()
    assert (BLOCKS / "flow_grpo.py").read_text() == flow_grpo_block()


def flow_grpo_block() -> str:
    """The spec's Flow-GRPO example: from its "import itertools" to its print."""
    lines = SPEC.read_text().split("\n")
    anchor = lines.index("from dew.objectives.rl import FlowGRPOObjective, FlowRollout")
    start = max(i for i in range(anchor) if lines[i] == "import itertools")
    end = next(i for i in range(anchor, len(lines)) if lines[i] == "print(int(state.updates))")
    return "\n".join(lines[start : end + 1]) + "\n"


def test_the_flow_grpo_block_prints_two_updates():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(BLOCKS / "flow_grpo.py")], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].endswith("2"), result.stdout[-500:]


def ppo_block() -> str:
    """The spec's PPO example: from its "import itertools" to its last assert."""
    lines = SPEC.read_text().split("\n")
    anchor = lines.index("from test_tool_episodes import ToolPolicy, Harness, verify, SAMPLING")
    start = max(i for i in range(anchor) if lines[i] == "import itertools")
    end = next(i for i in range(anchor, len(lines)) if lines[i].startswith("assert int(state.updates) == 2"))
    return "\n".join(lines[start : end + 1]) + "\n"


@pytest.mark.slow
def test_the_ppo_block_runs_from_a_checkout_with_the_tests_on_the_path():
    """The spec runs it with PYTHONPATH=src:tests; this checkout has no src/ layout, so the root and tests/, as
    docs/objectives/ppo.md's command says, run as written."""
    text = (ROOT / "docs/objectives/ppo.md").read_text()
    command = text.split("```bash\n")[1].split("```")[0].strip()
    assert command == "PYTHONPATH=.:tests uv run python examples/spec/ppo.py", command
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(["bash", "-c", command], env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "updates 2" in result.stdout


@pytest.fixture(scope="module")
def prelude():
    return import_from("examples", "tinystories")


@pytest.mark.slow
def test_prelude_keeps_the_spec_rows_within_their_widths(prelude):
    tokenizer = prelude.tokenizer
    prompt = tokenizer.encode("Tom had a red ball.")
    rejected = tokenizer.encode(" He kicked kicked kicked it.")
    assert len(prompt + rejected) <= 16  # PreferencePairs(seq_len=16) in the DPO block
    grpo_prompt = tokenizer.encode("Once upon a time, there was a little")
    assert len(grpo_prompt) + 8 <= prelude.model.max_seq_len  # P + R tokens of context in the GRPO block


def run_block(prelude, name: str, namespace: dict | None = None) -> dict:
    """Run examples/spec/<name>.py in the prelude's namespace (plus what earlier blocks defined)."""
    namespace = {**{n: getattr(prelude, n) for n in prelude.__all__}, **(namespace or {})}
    exec(compile((BLOCKS / f"{name}.py").read_text(), f"spec/{name}.py", "exec"), namespace)
    return namespace


@pytest.mark.slow
@pytest.mark.parametrize("order", [("sft", "dpo", "grpo"), ("grpo", "dpo", "sft")])
def test_blocks_run_in_any_order_from_lm_state(prelude, order):
    before = jax.device_get(prelude.lm_state.params)
    namespace = {}
    for name in order:
        namespace = run_block(prelude, name, namespace)
    assert int(namespace["sft_state"].step) == 20 and int(namespace["dpo_state"].step) == 10
    assert int(namespace["rl_state"].updates) == 20
    for a, b in zip(jax.tree.leaves(prelude.lm_state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)  # each stage starts from lm_state.params and leaves it intact
    for state in ("dpo_state", "rl_state"):  # DPO's and GRPO's reference is the starting policy
        for a, b in zip(jax.tree.leaves(namespace[state].ema), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_grpo_block_raises_the_share_of_dog_stories(prelude):
    """The spec's GRPO example on the stand-in decoder. Of 128 completions sampled with the
    block's own settings (seeded), the share that mention a dog must rise over the block's
    20 updates, and by at least 0.5 after 40 more updates of the same objective and
    rollout (docs/objectives/grpo.md reports the three shares)."""
    namespace = run_block(prelude, "grpo")
    rollout, batch = namespace["rollout"], namespace["prompt_batch"]
    measure = namespace["SampledRollout"](
        rollout.objective, reward=rollout.reward, groups=16, max_new_tokens=8, sampling=rollout.sampling,
        decode=rollout.decode,
    )

    def share(params):
        measure(batch, params, 0, jax.random.key(2024))
        return measure.metrics["reward/share_positive"]

    before, after_block = share(prelude.lm_state.params), share(namespace["rl_state"].params)
    trainer = namespace["Trainer"](rollout.objective, namespace["optax"].adamw(1e-4), key=jax.random.key(3),
                                   rollout=rollout, progress=False)
    state = namespace["rl_state"]
    for _ in range(40):
        state, _ = trainer.step(state, batch)
    after = share(state.params)
    print(f"completions mentioning a dog: {before * 128:.0f}/128 before, {after_block * 128:.0f}/128 after the "
          f"block's 20 updates, {after * 128:.0f}/128 after 60")
    assert after_block > before and after >= before + 0.5, (before, after_block, after)


@pytest.mark.slow
def test_sft_block_runs_after_the_prelude_and_leaves_lm_state_usable(prelude):
    before = jax.device_get(prelude.lm_state.params)
    code = (BLOCKS / "sft.py").read_text()
    for _ in range(2):  # any order, each starting from lm_state.params
        namespace = {name: getattr(prelude, name) for name in prelude.__all__}
        exec(compile(code, "spec/sft.py", "exec"), namespace)
        state = namespace["sft_state"]
        assert int(state.step) == 20 and int(state.updates) == 20
    for a, b in zip(jax.tree.leaves(prelude.lm_state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    objective, batch = namespace["sft_objective"], namespace["sft_batch"]
    start_loss, _ = objective.loss(prelude.lm_state.params, None, batch, None)
    end_loss, metrics = objective.loss(state.params, None, batch, None)
    assert float(metrics["target_tokens"]) == 8 * len(namespace["response"])  # assistant targets only
    assert float(end_loss) < 0.5 * float(start_loss)


DOC_PYTHON_PAGES = ("docs/trainer.md", "docs/sharding.md", "docs/engines.md")


def test_the_docs_python_blocks_run(capsys, vllm_engine):
    # vllm_engine: the vLLM block starts an engine of its own from the environment that fixture builds
    namespaces = []
    for page in DOC_PYTHON_PAGES:
        text = (ROOT / page).read_text()
        blocks = [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
        assert len(blocks) == 1, f"{page}: one python example"
        namespaces.append({})
        exec(compile(blocks[0], page, "exec"), namespaces[-1])
    trained, sharded, engine = namespaces
    assert int(trained["state"].updates) == 20
    assert sharded["trainer"].mesh.shape["fsdp"] == 1  # this process's one device
    assert "params/params/layers_0/input_layernorm/scale" in sharded["trainer"].plan.replicated
    assert len(engine["draw"].ids) == 8 and engine["draw"].version == 0 and engine["server"].version == 1
    assert max(engine["push"].published.values()) < 1e-5  # the push landed


def test_the_spec_import_paths_name_real_objects():
    """Every name the spec imports from dew.objectives.rl, and the modules it names by path, import as written."""
    import importlib

    import dew.objectives.rl as rl
    from dew.collection import episode_rollout, flow_rollout, ppo_rollout, sampled_rollout, scheduler, sources, tasks
    from dew.objectives import dpo, flow_grpo, grpo, ppo
    from dew.records import episode_protocol as episodes
    from dew.records import session_records as sessions

    spec_names = {"DPOObjective": dpo, "GRPOObjective": grpo, "SampledRollout": sampled_rollout,
                  "RolloutScheduler": scheduler, "SchedulerRecord": scheduler, "PromptSource": sources,
                  "EnvironmentSource": sources, "EpisodeId": episodes, "Observation": episodes, "Action": episodes,
                  "Transition": episodes, "Episode": episodes, "Environment": episodes, "task_ids": tasks,
                  "prompt_tasks": tasks, "FlowGRPOObjective": flow_grpo, "FlowRollout": flow_rollout,
                  "EpisodeRollout": episode_rollout, "PPOObjective": ppo, "PPORollout": ppo_rollout, "ValueHead": ppo}
    for name, home in spec_names.items():
        assert name in rl.__all__ and hasattr(rl, name), name
        assert getattr(rl, name) is getattr(home, name), name  # the one object, re-exported from its home
    facade = importlib.import_module("dew.objectives.rl.sessions")
    for name in ("Call", "Session", "Status", "Task", "SessionSource", "pack", "chain_lengths", "rows_needed",
                 "session_metrics"):
        assert hasattr(facade, name), name
    assert facade.Session is sessions.Session
    for module in ("dew.inference", "dew.sampling"):
        importlib.import_module(module)
    import dew

    for name in ("Field", "InputSpec", "Trainer", "models", "presets"):
        assert hasattr(dew, name), name
    assert hasattr(dew.models, "SimpleDiT") and hasattr(dew.presets, "Flow")


def test_nothing_in_the_project_imports_through_the_spec_facade():
    """``dew.objectives.rl`` is the spec's import paths only: the project imports every name from its home, so the
    facade never decides the layers; only the spec's own examples (examples/spec, and examples/dpo_offline.py, the
    spec's offline DPO block verbatim) and the test above use it."""
    import ast

    spec_users = [Path(p) for p in ("examples/spec", "examples/dpo_offline.py", "dew/objectives/rl",
                                    "tests/test_spec_examples.py")]
    users = []
    for path in sorted(ROOT.glob("**/*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0].startswith(".") or any(relative == p or p in relative.parents for p in spec_users):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(relative))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name == "dew.objectives.rl" or name.startswith("dew.objectives.rl.") for name in names):
                users.append(f"{relative}:{node.lineno}")
    assert not users, f"these import through the spec facade instead of the names' homes: {users}"


@pytest.mark.slow
def test_the_ppo_epochs_example_trains_four_updates_on_one_collection():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "ppo_epochs.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "epoch 4:" in result.stdout


def test_the_flow_grpo_brightness_example_writes_its_table_picture_and_figures(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "flow_grpo_brightness.py"), "--updates", "3",
                             "--seeds", "0", "--out", str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (row,) = json.loads((tmp_path / "flow_grpo_brightness.json").read_text())
    assert row["updates"] == 3 and set(row) >= {"ode_before", "ode_after", "sde_before", "sde_after"}
    assert (tmp_path / "flow_grpo_brightness.png").stat().st_size > 1000
