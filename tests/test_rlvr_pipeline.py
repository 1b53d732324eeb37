"""The RLVR pipeline on Ray: config checks, the driver API end to end with the dashboard series, cluster configs,
``ray job submit`` against a head this test starts, and a killed driver resuming from its checkpoint."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.numpy import load_file

ray = pytest.importorskip("ray")

from conftest import ROOT, free_port, import_from, make_parity_judge, run_python, wait_for_job_agent  # noqa: E402

from dew.collection.scoring import completion_ids  # noqa: E402
from dew.data.verifiable import task_tokenizer  # noqa: E402
from dew.models.packed_attention import SharedPromptRows  # noqa: E402
from dew.recipes.run_inputs import load_tokenizer  # noqa: E402
from dew.records.verl_rows import from_verl, to_verl  # noqa: E402
from dew_ray.pipelines.rlvr import RLVRPipeline, RLVRPipelineConfig, load_config  # noqa: E402
from tracker_files import tensorboard_scalars, wandb_history  # noqa: E402

processes = import_from("bench", "processes")

VERL_PARQUET = ROOT / "tests" / "fixtures" / "verl_gsm8k_tool_agent_loop.parquet"  # tools/verl_interop_reference.py

# Small enough for a couple of minutes on 2 cores; the warm start is short, so rewards stay near zero here.
TINY = ["steps=3", "sft_steps=10", "tasks_per_step=2", "samples=4", "max_new_tokens=40", "eval_tasks=4",
        "eval_samples=1", "train_tasks=100", "checkpoint_every=1", "runner=process", "progress=false"]


def tiny(run_dir, **values):
    return load_config(None, TINY, run_dir=str(run_dir), **values)


def test_config_file_overrides_and_named_errors(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[rlvr]\nsteps = 7\nservers = 2\nprompts = "none.jsonl"\n')
    with pytest.raises(ValueError, match="'prompts' names 'none.jsonl', which is not a file or directory"):
        load_config(path)
    path.write_text('[rlvr]\nsteps = 7\nservers = 2\n')
    config = load_config(path, ["max_lag=2", "ahead=2", "learning_rate=3e-4", "progress=no"])
    assert (config.steps, config.servers, config.max_lag, config.ahead, config.progress) == (7, 2, 2, 2, False)
    assert config.learning_rate == 3e-4
    with pytest.raises(ValueError, match="unknown config field 'stepz'"):
        load_config(None, ["stepz=3"])
    assert load_config(None, ["trackers=tensorboard,wandb"]).trackers == ["tensorboard", "wandb"]
    assert load_config(None, ['trackers=["wandb"]', "wandb_mode=online"]).experiment_trackers()[0].mode == "online"
    with pytest.raises(ValueError, match="cannot read 'mlflow' as config field 'trackers' \\(one of 'tensorboard' or"):
        load_config(None, ["trackers=mlflow"])
    with pytest.raises(ValueError, match="cannot read 'many' as config field 'servers'"):
        load_config(None, ["servers=many"])
    with pytest.raises(ValueError, match="'max_lag' \\(0\\) must be at least ahead \\+ sync_every - 1 = 1"):
        load_config(None, ["max_lag=0"])
    with pytest.raises(ValueError, match="'samples' must be an integer >= 2, got 1"):
        RLVRPipelineConfig(samples=1)
    with pytest.raises(ValueError, match="config field 'trainer_cpus' must be a number, got 'one'"):
        RLVRPipelineConfig(trainer_cpus="one")
    path.write_text("steps = 3\nwidth = 9\n")
    with pytest.raises(ValueError, match="unknown config field 'width'"):
        load_config(path)
    # verl's and TRL's names point to dew's fields, in a file and in an override
    path.write_text("[rlvr]\ntrain_files = 'gsm8k/train.parquet'\n")
    with pytest.raises(ValueError, match="unknown config field 'train_files' \\(other tools' name for 'prompts'"):
        load_config(path)
    with pytest.raises(ValueError, match="'max_response_length' in override .* name for 'max_new_tokens': set"):
        load_config(None, ["max_response_length=64"])


def scrape(port: int, names: list[str], expect: dict[str, float], timeout: float = 60) -> dict[str, float]:
    """Values of the named series (Ray prefixes them with ``ray_``) from the node's Prometheus endpoint.

    Ray exports gauges every few seconds, so an early read can hold values set before
    the last update: read until every name is there with the ``expect``ed values, or
    until ``timeout``, and return what the last read held.
    """
    deadline = time.monotonic() + timeout
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {}
        for line in body.splitlines():
            for name in names:
                if line.startswith(f"ray_{name}{{"):
                    found[name] = float(line.rsplit(" ", 1)[1])
        if set(found) == set(names) and all(found[name] == value for name, value in expect.items()):
            return found
        time.sleep(2)
    missing = sorted(set(names) - set(found))
    assert not missing, f"series missing from the metrics endpoint: {missing}"
    return found


@pytest.mark.ray
@pytest.mark.slow
def test_the_driver_api_runs_a_pipeline_and_the_dashboard_series_are_exported(tmp_path, qwen3_gsm8k):
    port = free_port()
    ray.init(address="local", num_cpus=3, include_dashboard=False, _metrics_export_port=port, log_to_driver=False,
             configure_logging=False)
    try:
        # A user's run: a Hugging Face Qwen3 directory (Qwen3's vocabulary and chat template) on GSM8K verl rows,
        # measured on GSM8K's test rows. Two trainer processes (one jax.distributed job), each scheduling its own
        # task of every batch, write each update's rollouts as verl rows.
        model, parquet, test = qwen3_gsm8k
        with RLVRPipeline(tiny(tmp_path / "run", trainers=2, trainer_cpus=0.5, model=str(model), prompts=str(parquet),
                               val_prompts=str(test), eval_samples=2, verl_rows=True, slots=8,
                               trackers=["tensorboard", "wandb"])) as pipeline:
            started = pipeline.start()
            assert not started["restored"] and started["step"] == 0
            rows = pipeline.step(2)
            assert [row["step"] for row in rows] == [1, 2] and len(rows[0]["tasks"]) == 2
            assert rows[1]["scheduler/admitted_groups"] == 1 and rows[1]["scheduler/lag"] <= 1  # process 0's group
            rows += pipeline.step(5)  # only one update is left to reach steps=3
            assert [row["step"] for row in pipeline.rows] == [1, 2, 3]
            values = scrape(port, ["dew_update_step", "dew_policy_version", "dew_policy_lag",
                                   "dew_trainer_wait_share", "dew_rollout_tokens_per_second"],
                            expect={"dew_update_step": 3, "dew_policy_version": 2})
            assert values["dew_update_step"] == 3 and values["dew_policy_version"] == 2
            summary = pipeline.finish()
        # the driver attached to this test's cluster, so it left it running
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    run = tmp_path / "run"
    assert summary["steps"] == 3 and 0 <= summary["wait_share"] <= 1
    assert set(summary["reward_after"]) == {"all", "stderr", "openai/gsm8k", "pass@2", "pass@2/openai/gsm8k"}
    # a random model never writes "#### <answer>": the summary says why the held-out reward stays 0
    assert summary["reward_after"]["all"] == 0 and "a random or untrained model" in summary["note"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:  # how a GRPO run is judged: rewards, groups without signal, response lengths, per source
        assert line["rollout/reward/source/openai/gsm8k"] == line["rollout/reward/mean"]
        assert 0 <= line["rollout/reward/equal_group_share"] <= 1 and line["rollout/reward/std"] >= 0
        assert 0 < line["rollout/response/length_mean"] <= line["rollout/response/length_max"] <= 40
        assert 0 <= line["rollout/response/truncated_share"] <= 1
    # the trackers got the same rows: TensorBoard events and the offline W&B run's history
    events = tensorboard_scalars(run / "tensorboard")
    assert events["train/loss"] == [(line["step"], pytest.approx(line["train/loss"])) for line in lines]
    assert [step for step, _ in events["held_out/all"]] == [0, 1, 2, 3]
    (wandb_run,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(wandb_run)
    assert [row["_step"] for row in history if "scheduler/lag" in row] == [1, 2, 3]
    assert (run / "rlvr.png").stat().st_size > 10_000 and (run / "summary.json").exists()
    # the held-out curve: before, after updates 1 and 2 (eval_points=3 of 3 updates, evenly spaced), and after
    curve = [json.loads(line) for line in (run / "held_out.jsonl").read_text().splitlines()]
    assert [point["step"] for point in curve] == [0, 1, 2, 3] and curve == summary["held_out"]
    assert curve[0]["reward"] == summary["reward_before"] and curve[-1]["reward"] == summary["reward_after"]
    rows = pq.read_table(parquet).to_pylist()
    truths = {row["reward_model"]["ground_truth"] for row in rows}
    tokenizer = pipeline.setup.tokenizer
    rendered = {tuple(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)) for row in rows}
    for line in lines:  # what it wrote reads back: every admitted rollout of both processes, whole groups
        written = read_verl_rows(run, line)
        assert len(written) == 2 * 4 and {s.task.data["ground_truth"] for s in written} <= truths
        assert sorted(s.sample for s in written) == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(s.reward in (0.0, 1.0) for s in written)
        assert all(tuple(s.calls[0].prompt_ids) in rendered for s in written)  # the chat template's rendering
    from dew.models.pretrained import Pretrained

    policy = Pretrained.from_directory(run / "policy")  # the final policy reads back from the Hugging Face layout
    variables = policy.load()
    assert policy.architecture == "Qwen3ForCausalLM" and policy.model().vocab_size == 151936
    assert variables["params"]["embed_tokens"]["embedding"].shape == (151936, 64)
    assert load_tokenizer(run / "policy").encode("#### 72") == tokenizer.encode("#### 72")


def read_verl_rows(run: Path, line: dict) -> list:
    """The sessions of one update's verl_rows file, checked against its metrics line: its tasks, at its version."""
    rows = [json.loads(text) for text in (run / "verl_rows" / f"update-{line['step']:06d}.jsonl").read_text().splitlines()]
    trajectories = from_verl(rows)
    assert all(t.described for t in trajectories) and to_verl(trajectories) == rows
    sessions = [t.session for t in trajectories]
    assert {s.task.id for s in sessions} == set(line["tasks"])
    assert min(c.version for s in sessions for c in s.calls) == line["scheduler/oldest_version"]
    for session in sessions:
        (call,) = session.calls
        assert call.behavior_log_probs and max(call.behavior_log_probs) <= 0 and call.finish_reason in ("stop", "length")
    return sessions


def test_cluster_configs_are_valid_for_ray_and_kuberay():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    launcher = yaml.safe_load((ROOT / "cluster_configs" / "ray-cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)  # the schema that ships inside the ray package
    validate_config(prepare_config(launcher))  # and with the launcher's defaults filled in, as `ray up` does
    image = import_from("tools", "container_env").PROJECT_IMAGE  # the image the repository's Dockerfile builds
    assert launcher["docker"]["image"] == image and "seccomp=unconfined" in " ".join(launcher["docker"]["run_options"])
    starts = [c for c in launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token " in command for command in starts)  # every node asks
    assert all("GLIBC_TUNABLES=glibc.malloc.hugetlb=1 " in command for command in starts)  # dew.hugepages
    assert launcher["file_mounts"]["/root/.ray/auth_token"] == "~/.ray/auth_token"  # for the same token

    for name in ("rayjob.yaml", "rayjob-vllm-gpu.yaml"):
        job = yaml.safe_load((ROOT / "cluster_configs" / name).read_text())
        assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
        entrypoint = job["spec"]["entrypoint"].split()
        assert entrypoint[:3] == ["python", "-m", "dew_ray.pipelines.rlvr"]
        config_path = entrypoint[entrypoint.index("--config") + 1]
        config = load_config(ROOT / config_path,
                             [item for i, item in enumerate(entrypoint) if entrypoint[i - 1] == "--set"])
        cluster = job["spec"]["rayClusterSpec"]
        assert cluster["rayVersion"] == ray.__version__
        pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
        tag = "latest" if name == "rayjob.yaml" else "vllm-cuda"  # the Dockerfile's image, with or without vLLM
        assert {c["image"] for pod in pods for c in pod["containers"]} == {image.replace(":latest", f":{tag}")}
        cpus = [float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])]
        cpus += [float(group["rayStartParams"]["num-cpus"]) * group["maxReplicas"]
                 for group in cluster["workerGroupSpecs"]]
        reserved = config.trainers * config.trainer_cpus + config.servers * config.server_cpus
        reserved += config.sandbox_runners * config.sandbox_cpus
        assert reserved <= sum(cpus)  # the job fits the cluster it asks for
        gpus = sum(float(group["rayStartParams"].get("num-gpus", 0)) * group["maxReplicas"]
                   for group in cluster["workerGroupSpecs"])
        assert config.servers * config.server_gpus <= gpus
        assert cluster["authOptions"] == {"mode": "token"}  # KubeRay makes the token and sets it on every pod
        assert "RAY_AUTH_MODE" not in yaml.safe_load(job["spec"]["runtimeEnvYAML"]).get("env_vars", {})
    assert (config.engine, config.server_gpus) == ("vllm", 1.0)  # the GPU variant: one GPU per vLLM engine


def readme_submit_lines() -> list[str]:
    """docs/tutorials/ray-cluster.md's ``ray job submit`` block, continuation lines joined, without its last line
    (``ray stop`` ends every Ray process on the machine; the test stops the head it started by its temporary
    directory)."""
    text = (ROOT / "docs/tutorials/ray-cluster.md").read_text()
    block = next(b for b in text.split("```bash\n")[1:] if "ray job submit" in b.split("```")[0]).split("```")[0]
    lines = block.replace("\\\n", " ").strip().splitlines()
    assert "get-auth-token --generate" in lines[0] and "ray start --head" in lines[1], lines
    assert "ray job submit" in lines[2] and "ray stop" in lines[-1], lines
    return lines[:-1]


def test_the_qwen3_gsm8k_gpu_recipe_is_a_valid_run_of_a_users_model(qwen3_gsm8k):
    """The GPU recipe's fields validate, and with its model and data paths pointed at the tiny Qwen3 and GSM8K rows
    (the recipe names a user's /data) the run it describes plans: GSM8K rows routed, the rows fit the model."""
    from dew.recipes.rlvr_plan import plan_run

    model, parquet, test = qwen3_gsm8k
    recipe = ROOT / "cluster_configs" / "rlvr-qwen3-gsm8k-gpu.toml"
    text = recipe.read_text()
    for name in ("/data/models/Qwen3-0.6B", "/data/gsm8k/train.parquet", "/data/gsm8k/test.parquet"):
        assert f'"{name}"' in text
    local = Path(str(parquet)).parent / "recipe.toml"
    local.write_text(text.replace("/data/models/Qwen3-0.6B", str(model))
                        .replace("/data/gsm8k/train.parquet", str(parquet)).replace("/data/gsm8k/test.parquet", str(test)))
    config = load_config(local)
    assert (config.engine, config.engine_push, config.dtype, config.enable_thinking) == ("vllm", "nccl", "bfloat16", False)
    assert config.servers * config.server_gpus + config.trainers * config.trainer_gpus == 3
    plan = plan_run(config)
    assert plan.width <= 256 + 512 and plan.reward == "verifiable" and plan.eos_ids == (151645, 151643)
    # the README's own run (its second section's TOML, which docs/tutorials/own-model.md repeats) plans the same way
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Your model, your data, your reward"):]
    block = section[section.index("```toml\n") + 8:section.index("```", section.index("```toml\n") + 8)]
    assert f"```toml\n{block}```" in (ROOT / "docs/tutorials/own-model.md").read_text()
    for name, value in (("models/Qwen3-0.6B", model), ("data/gsm8k/train.parquet", parquet),
                        ("data/gsm8k/test.parquet", test)):
        assert f'"{name}"' in block
        block = block.replace(f'"{name}"', f'"{value}"')
    local.write_text(block)
    assert plan_run(load_config(local)).held_out_source == f"val_prompts {test}"


@pytest.mark.ray
@pytest.mark.slow
def test_the_job_submit_lines_work_as_written_on_this_machine():
    """Runs docs/tutorials/ray-cluster.md's ``ray start`` and ``ray job submit`` lines exactly (from the checkout,
    through ``uv run``) and reads the outputs where the page says they are; then a relative run_dir under a submitted
    job is refused before any work starts, with the advice the page gives."""
    lines = readme_submit_lines()
    temp_dir = lines[1].split("--temp-dir")[1].split()[0]
    outputs = ROOT / "runs" / "jobsub"
    shutil.rmtree(outputs, ignore_errors=True)
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    try:
        head = subprocess.run(["bash", "-ec", "\n".join(lines[:2])], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert head.returncode == 0, head.stdout[-3000:] + head.stderr[-3000:]
        wait_for_job_agent("http://127.0.0.1:8265")  # the page says to run the submit again when Ray asks that
        ran = subprocess.run(["bash", "-ec", "\n".join(lines[2:])], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=900)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        assert "succeeded" in ran.stdout.lower() and "held-out reward" in ran.stdout
        assert f"run directory {outputs}" in ran.stdout and "sandbox for code tasks: bubblewrap" in ran.stdout
        summary = json.loads((outputs / "summary.json").read_text())
        assert summary["steps"] == 20 and summary["run_dir"] == str(outputs)
        assert (outputs / "policy" / "model.safetensors").exists() and (outputs / "rlvr.png").exists()
        steps = [json.loads(line)["step"] for line in (outputs / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 21))
        # the head asks for Ray's token: the same job list without it is refused
        unauthenticated = subprocess.run(["bash", "-c", "uv run ray job list --address http://127.0.0.1:8265"],
                                         cwd=ROOT, env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True,
                                         text=True, timeout=120)
        assert unauthenticated.returncode != 0, unauthenticated.stdout[-2000:]
        assert "auth" in (unauthenticated.stdout + unauthenticated.stderr).lower()
        listed = subprocess.run(["bash", "-c", "RAY_AUTH_MODE=token uv run ray job list --address http://127.0.0.1:8265"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0 and "SUCCEEDED" in listed.stdout, listed.stdout[-2000:] + listed.stderr[-2000:]
        relative = lines[2].replace("run_dir=$PWD/runs/jobsub", "run_dir=runs/jobsub-relative")
        refused = subprocess.run(["bash", "-c", relative], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=600)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0
        assert "'run_dir' is relative ('runs/jobsub-relative') and this driver runs as a submitted Ray job" in said
        assert "--set run_dir=$PWD/runs/jobsub-relative" in said
    finally:
        processes.stop_ray_head(temp_dir, 6379)  # the page's head: Ray's default GCS port
        shutil.rmtree(outputs, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_main_job_resumes_from_its_checkpoint(container_image):
    """``dew-ray rlvr`` on a relative run directory, as a user runs it: SIGKILL of the driver and its local cluster
    once update 3 is written (checkpoints every 2 updates), then the same command again. The rerun resumes at the
    last checkpoint the kill left, keeps the rows up to it as they were, trains each update once, and ends on the
    parameters of an uninterrupted run (synchronous schedule: every batch drawn under one version, so runs draw
    alike). Then the uninterrupted run's exported policy reads back as a user's model. The code tasks run with
    ``runner = "container"``: each program in a fresh Docker container (the containers of the killed run are
    removed by their watchers)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    name = f"kill-test-{os.getpid()}"
    # 80 warm-start steps from a teacher without slips: about half the training rewards are 1, so groups are
    # mixed and the updates move the policy (40 steps, or the default teacher's slips, leave nearly every reward 0)
    options = [*TINY, "steps=5", "sft_steps=80", "sft_errors=0", "checkpoint_every=2", "max_lag=0", "ahead=0",
               "verl_rows=true", "runner=container", f"container_image={container_image}", "sandbox_workers=4"]
    command = [str(Path(sys.executable).parent / "dew-ray"), "rlvr", *[f"--set={item}" for item in options]]
    killed, uninterrupted, more = ROOT / "runs" / name, ROOT / "runs" / f"{name}-whole", ROOT / "runs" / f"{name}-more"
    try:
        driver = subprocess.Popen([*command, f"--run-dir=runs/{name}"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        metrics = killed / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and driver.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.02)
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and everything it started
        driver.wait(60)
        before = [json.loads(line) for line in metrics.read_text().splitlines()]
        # orbax names a finished checkpoint by its step; one the kill interrupted has a temporary name
        checkpoint = max(int(p.name) for p in (killed / "grpo").iterdir() if p.name.isdigit())
        assert 2 <= checkpoint <= len(before) < 5, (checkpoint, len(before), driver.stdout.read().decode()[-3000:])

        resumed = subprocess.run([*command, f"--run-dir=runs/{name}"], env=env, cwd=ROOT, capture_output=True,
                                 text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert "has constructor arguments in the object store" not in resumed.stderr, resumed.stderr[-3000:]
        assert f"resumed {killed} at update {checkpoint}" in resumed.stdout, resumed.stdout[-3000:]
        assert "sandbox for code tasks: docker " in resumed.stdout and f"image {container_image}" in resumed.stdout
        left = subprocess.run(["docker", "ps", "--all", "--quiet", "--filter", "name=dew-sandbox-"],
                              capture_output=True, text=True, timeout=60).stdout.split()
        assert left == []  # the killed run's containers were removed by their watchers, the finished run's by it
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]  # every update once; the first after the restart
        assert rows[:checkpoint] == before[:checkpoint]  # is the checkpoint's + 1, and the rows up to it are kept
        for step in range(checkpoint, len(before)):  # updates trained after the checkpoint, before the kill,
            assert rows[step]["wall"] != before[step]["wall"]  # were trained again
        assert any(row["train/loss"] != 0 for row in rows)  # the policy moved
        tasks = [task for row in rows for task in row["tasks"]]
        assert len(tasks) == 10 and len(set(tasks)) == 10  # every batch of the one epoch-ordered stream, once each
        # the verl rows of updates trained again were rewritten, not added to: one file per update, of its tasks
        assert sorted(p.name for p in (killed / "verl_rows").iterdir()) == [f"update-{s:06d}.jsonl" for s in range(1, 6)]
        assert sum(len(read_verl_rows(killed, row)) for row in rows) == 5 * 2 * 4
        # the held-out curve has each of its points once: after the warm start, updates 1, 2 and 4, and the end
        curve = [json.loads(line)["step"] for line in (killed / "held_out.jsonl").read_text().splitlines()]
        assert curve == [0, 1, 2, 4, 5]
        # The record spans the kill: trained again from it, in one process without Ray, servers or sandboxes, every
        # update lands on the parameters the run recorded, and on its checkpoints bit for bit.
        replayed = subprocess.run([str(Path(sys.executable).parent / "dew-ray"), "replay", f"runs/{name}"], env=env,
                                  cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
        assert "replayed 5 steps (5 updates)" in replayed.stdout and "5 equal" in replayed.stdout, replayed.stdout
        assert "every update's parameters equal the record's" in replayed.stdout, replayed.stdout

        # The uninterrupted run starts from the same warm start (read back, as the resumed run read it), which
        # leaves the 80 SFT steps out of its time; its GRPO updates run from the first to the last without a stop.
        uninterrupted.mkdir(parents=True)
        shutil.copy(killed / "warm_start.msgpack", uninterrupted / "warm_start.msgpack")
        whole = subprocess.run([*command, f"--run-dir=runs/{name}-whole"], env=env, cwd=ROOT, capture_output=True,
                               text=True, timeout=900)
        assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
        got, want = (load_file(run / "policy" / "model.safetensors") for run in (killed, uninterrupted))
        assert sorted(got) == sorted(want)
        # The server's behaviour log-probabilities depend, in their last float32 bits, on which requests share a
        # prefill, and Adam can turn that into ~1e-6 on an element whose gradient is near zero: two uninterrupted
        # runs differ on at most a handful of the 340k elements by over 1e-6. A resume from the wrong state or data
        # moves nearly every element (the group numbering this test found moved 99% of them by up to 1.2e-3).
        # (A rerun from zero is what the checks above catch.)
        moved = sum(int((np.abs(got[t] - want[t]) > 1e-6).sum()) for t in want)
        elements = sum(want[t].size for t in want)
        assert moved <= elements // 1000, f"{moved} of {elements} elements differ by more than 1e-6"
        worst = max(float(np.abs(got[t] - want[t]).max()) for t in want)
        assert worst < 1e-4, worst

        # The exported policy is a model a user brings: `--set model=<run>/policy` reads the Hugging Face directory
        # and its tokenizer back as the run's policy, with no warm start, and its weights are the run's last.
        # (The driver API reads it through the same plan before any actor starts.)
        continued = RLVRPipeline(load_config(None, options, run_dir=str(more), model=str(uninterrupted / "policy")))
        plan = continued.preflight_plan()
        assert plan.describe()[0].startswith(f"policy: LlamaForCausalLM from {uninterrupted / 'policy'}")
        assert not continued.needs_warm_start()
        read = plan.policy.pretrained.export(plan.policy.params)
        assert sorted(read) == sorted(want) and all(np.array_equal(read[t], want[t]) for t in want)
    finally:
        shutil.rmtree(killed, ignore_errors=True)
        shutil.rmtree(uninterrupted, ignore_errors=True)
        shutil.rmtree(more, ignore_errors=True)


def test_a_users_model_and_prompts_are_read_rendered_and_checked_before_any_work(qwen3_gsm8k, tmp_path,
                                                                                 monkeypatch):
    from dew.recipes.rlvr_plan import PlanError, plan_run

    model, parquet, _ = qwen3_gsm8k
    rows = pq.read_table(parquet).to_pylist()
    plan = plan_run(load_config(None, [f"model={model}", f"prompts={parquet}", "max_new_tokens=32"]))
    tokenizer = plan.policy.tokenizer
    rendered = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                            return_dict=False) for row in rows]
    assert plan.train.ids == [list(ids) for ids in rendered]  # prompt ids are the chat template's rendering
    assert plan.eos_ids == (151645, 151643)  # <|im_end|>, then generation_config.json's <|endoftext|>
    assert plan.width == max(map(len, rendered)) + 32 and plan.policy.model.vocab_size == 151936
    assert plan.held_out.rows == rows and "which training sees too" in plan.held_out_source
    # verl's own parquet (its gsm8k tool-agent loop's: a system message, then the question) as the measured prompts
    verl = plan_run(load_config(None, [f"model={model}", f"prompts={parquet}", f"val_prompts={VERL_PARQUET}"]))
    verl_rows = pq.read_table(VERL_PARQUET).to_pylist()
    assert verl.held_out.ids == [list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False))
                                 for row in verl_rows]
    assert verl.prompt_len == max(map(len, verl.held_out.ids)) and verl.held_out_source == f"val_prompts {VERL_PARQUET}"
    # the built-in decoder on these prompts: its warm start's demonstrations must fit the rows too
    built_in_config = load_config(None, [f"prompts={parquet}"])
    built_in = plan_run(built_in_config)
    demos = max(len(built_in.policy.tokenizer.encode(t.prompt, add_special_tokens=False)) for t in built_in.built_in)
    assert built_in.prompt_len == max(built_in.train.longest, built_in.held_out.longest, demos)
    # its positions reach as far as a packed row of shared prompts (a task's prompt once, then a slot per sample)
    shared = SharedPromptRows(built_in.prompt_len - 1, built_in_config.samples, built_in.width - built_in.prompt_len + 1)
    assert built_in.policy.model.max_seq_len == shared.width > built_in.width and built_in.train.rows == rows
    thinking = plan_run(load_config(None, [f"model={model}", f"prompts={parquet}", "enable_thinking=false"]))
    assert thinking.train.ids[0] == list(tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True,
                                                                       tokenize=True, enable_thinking=False,
                                                                       return_dict=False))
    assert thinking.train.ids[0] != plan.train.ids[0]  # the template's switch took effect
    # the same rows as JSON lines and as a directory datasets saved read alike
    import datasets

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in (jsonl, tmp_path / "saved"):
        assert plan_run(load_config(None, [f"model={model}", f"prompts={source}"])).train.ids == plan.train.ids
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(PlanError, match="has splits \\['train'\\].*give a split's own directory, such as .*dict/train"):
        plan_run(load_config(None, [f"model={model}", f"prompts={tmp_path / 'dict'}"]))
    # max_prompt_length: longer prompts are left out and counted (verl's filter_overlong_prompts), or all refused
    lengths = sorted(map(len, rendered))
    fitted = plan_run(load_config(None, [f"model={model}", f"prompts={parquet}", f"max_prompt_length={lengths[0]}"]))
    assert fitted.train.filtered == sum(n > lengths[0] for n in lengths) > 0 and fitted.train.longest == lengths[0]
    assert any("prompts longer than it were left out" in line for line in fitted.describe())
    with pytest.raises(PlanError, match=f"'max_prompt_length' \\(4\\) is shorter than every prompt .* from "
                                        f"{lengths[0]} to {lengths[-1]} ids"):
        plan_run(load_config(None, [f"model={model}", f"prompts={parquet}", "max_prompt_length=4"]))
    with pytest.raises(PlanError, match=f"rows of {lengths[-1] + 2000} ids \\(the longest prompt: {lengths[-1]} ids, "
                                        "\\+ max_new_tokens=2000\\) exceed the model's context, "
                                        "max_position_embeddings=1024"):
        plan_run(load_config(None, [f"model={model}", f"prompts={parquet}", "max_new_tokens=2000"]))
    # bad model directories, tokenizers and prompt files are named
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PlanError, match="'model': .*empty has no config.json"):
        plan_run(load_config(None, [f"model={empty}", f"prompts={parquet}"]))
    (empty / "config.json").write_text((model / "config.json").read_text())
    with pytest.raises(PlanError, match="'model': .*empty has neither model.safetensors nor"):
        plan_run(load_config(None, [f"model={empty}", f"prompts={parquet}"]))
    (empty / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(PlanError, match="architectures \\['GPT2LMHeadModel'\\] holds none that dew reads"):
        plan_run(load_config(None, [f"model={empty}", f"prompts={parquet}"]))
    plain = tmp_path / "plain-tokenizer"
    words = task_tokenizer()
    words.chat_template = None
    words.save_pretrained(plain)
    with pytest.raises(PlanError, match="'prompts': .*row 0.*holds messages but the tokenizer has no chat template"):
        plan_run(load_config(None, [f"model={model}", f"tokenizer={plain}", f"prompts={parquet}"]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(rows[0]) + "\n" + json.dumps({k: v for k, v in rows[1].items() if k != "prompt"}))
    with pytest.raises(PlanError, match="broken.jsonl row 1 has no 'prompt' column"):
        plan_run(load_config(None, [f"model={model}", f"prompts={broken}"]))
    broken.write_text(json.dumps({**rows[0], "reward_model": {"style": "rule"}}) + "\n")
    with pytest.raises(PlanError, match="row 0 has no reward_model.ground_truth"):
        plan_run(load_config(None, [f"model={model}", f"prompts={broken}"]))
    # a data source no route scores is refused, naming it and the routes; the user's own reward is found by path
    broken.write_text(json.dumps({**rows[0], "data_source": "my/quiz"}) + "\n")
    with pytest.raises(PlanError, match="data_source 'my/quiz', which no reward route scores; the routes are .*"
                                        "'openai/gsm8k'"):
        plan_run(load_config(None, [f"model={model}", f"prompts={broken}"]))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quiz_rewards.py").write_text("def score(data_source, completion, ground_truth, extra_info):\n"
                                              "    return float(ground_truth in completion)\n")
    for spec in ("quiz_rewards.py:score", "quiz_rewards:score"):  # a file path, or a module in the working directory
        reward = plan_run(load_config(None, [f"model={model}", f"prompts={broken}", f"reward={spec}"])).reward
        assert reward("my/quiz", "it is 7", "7", "{}") == 1.0 and reward.spec == spec
    with pytest.raises(PlanError, match="no module 'nowhere' on sys.path or in the working directory .*; give a file "
                                        "path instead"):
        plan_run(load_config(None, [f"model={model}", f"prompts={broken}", "reward=nowhere:score"]))
    with pytest.raises(PlanError, match="quiz_rewards.py has no function 'grade'"):
        plan_run(load_config(None, [f"model={model}", f"prompts={broken}", "reward=quiz_rewards.py:grade"]))
    with pytest.raises(ValueError, match="config field 'tokenizer' needs 'model'"):
        load_config(None, [f"tokenizer={plain}"])
    with pytest.raises(ValueError, match="'warmup_steps' \\(3\\) must be less than steps \\(3\\)"):
        load_config(None, ["steps=3", "warmup_steps=3"])


def test_a_warm_start_file_fits_a_users_model_to_its_conversations(qwen3_gsm8k, tmp_path):
    import jax

    from dew.recipes.rlvr_recipe import warm_start
    from dew.recipes.run_inputs import load_policy

    model, parquet, _ = qwen3_gsm8k
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                                     {"role": "assistant", "content": f"#### {a + b}"}]}) + "\n"
                            for a, b in ((3, 4), (5, 6), (1, 9), (2, 2))))
    config = tiny(tmp_path / "run", model=str(model), prompts=str(parquet), warm_start=str(chat), sft_steps=3)
    pipeline = RLVRPipeline(config)
    assert pipeline.needs_warm_start()  # a user's model with a warm_start file is fitted first, once
    policy = load_policy(model)
    fitted = warm_start(policy.model, policy.tokenizer, [], 64, 3, 2, 1e-2, key=jax.random.key(0),
                        pretrained=policy.params, conversations=str(chat), progress=False)
    start, end = jax.tree.leaves(policy.params), jax.tree.leaves(fitted)
    assert len(start) == len(end) and sum(not np.array_equal(a, b) for a, b in zip(start, end)) == len(start)
    assert not RLVRPipeline(tiny(tmp_path / "run2", model=str(model), prompts=str(parquet))).needs_warm_start()


def test_a_ray_temp_dir_inside_the_directory_rays_uv_hook_packages_is_refused(tmp_path, monkeypatch):
    from dew_ray.pipelines import run_dirs

    monkeypatch.setattr(run_dirs, "_get_uv_run_cmdline", lambda: ["uv", "run", "dew-ray", "rlvr"])  # under uv run
    inside = {"RAY_TMPDIR": str(tmp_path / "raytmp")}
    with pytest.raises(run_dirs.PreflightError, match=f"RAY_TMPDIR \\({tmp_path}/raytmp\\) is inside the working "
                                                      f"directory {tmp_path}, which Ray packages"):
        run_dirs.check_packaged_temp_dir(inside, cwd=tmp_path)
    run_dirs.check_packaged_temp_dir({"RAY_TMPDIR": "/tmp/elsewhere"}, cwd=tmp_path)  # outside: fine
    run_dirs.check_packaged_temp_dir({}, cwd=tmp_path)  # Ray's default, /tmp/ray
    monkeypatch.setattr(run_dirs, "_get_uv_run_cmdline", lambda: None)  # not under uv run: nothing is packaged
    run_dirs.check_packaged_temp_dir(inside, cwd=tmp_path)


def test_checks_that_can_fail_early_fail_before_any_work(tmp_path, monkeypatch, container_image):
    from dew_ray.pipelines import rlvr as pipeline
    from dew_ray.pipelines import run_dirs

    with pytest.raises(pipeline.PreflightError, match="'run_dir' is a URI \\('s3://bucket/run'\\)"):
        pipeline.resolve_run_dir("s3://bucket/run")
    assert pipeline.resolve_run_dir("runs/x") == Path.cwd() / "runs" / "x"  # relative: against the driver's cwd
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what the job supervisor sets for a submitted driver
    with pytest.raises(pipeline.PreflightError, match="--set run_dir=\\$PWD/runs/x"):
        pipeline.resolve_run_dir("runs/x")
    assert pipeline.resolve_run_dir(str(tmp_path / "abs")) == tmp_path / "abs"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    started = time.monotonic()
    with pytest.raises(pipeline.PreflightError, match="is not writable .* set run_dir to a directory you can write"):
        RLVRPipeline(tiny(blocked / "run")).preflight()

    # runner = "container" on an image Docker does not have: refused with Docker's own words (nothing is pulled)
    with pytest.raises(pipeline.PreflightError, match="the container sandbox could not run a program \\(failed, exit "
                                                      "125\\): .*dew-ray/no-such-image"):
        RLVRPipeline(tiny(tmp_path / "run0", runner="container", container_image="dew-ray/no-such-image:0")).preflight()
    assert "image dew-ray/base" in run_dirs.describe_runner(run_dirs.check_sandbox("container", container_image))

    def no_bubblewrap(name, image):
        raise RuntimeError("bubblewrap ('bwrap') is not installed (apt-get install bubblewrap)")

    monkeypatch.setattr(run_dirs, "sandbox_runner", no_bubblewrap)
    with pytest.raises(pipeline.PreflightError, match="the sandbox for code tasks cannot start here: .*apt-get"):
        RLVRPipeline(tiny(tmp_path / "run", runner="bwrap")).preflight()
    assert time.monotonic() - started < 10  # seconds, not a warm start


@pytest.mark.ray
def test_a_cluster_without_the_cpus_is_refused_before_the_warm_start(tmp_path):
    from dew_ray.pipelines import rlvr as pipeline

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        run = tmp_path / "run"
        with pytest.raises(pipeline.PreflightError, match="reserves 9.25 CPUs .* the Ray cluster has 2"):
            with RLVRPipeline(tiny(run, trainer_cpus=8.0)) as driver:
                driver.start()
        assert not (run / "warm_start.msgpack").exists()
        with pytest.raises(pipeline.PreflightError, match="'max_new_tokens' \\(4\\) is shorter than the longest"):
            with RLVRPipeline(tiny(run, max_new_tokens=4, server_cpus=0.5)) as driver:
                driver.start()
        assert not (run / "warm_start.msgpack").exists()
    finally:
        ray.shutdown()



@pytest.mark.ray
def test_without_an_address_a_run_starts_a_cluster_of_its_own_where_ray_start_left_one_recorded():
    """Ray records the address of the last cluster ``ray start`` began in ``<temp dir>/ray/ray_current_cluster`` and a
    bare ``ray.init()`` attaches to it, even after that cluster died (the file stays). ``start_ray`` without an
    address (and without RAY_ADDRESS) starts a local cluster of the run's own instead: here beside a recorded
    address nothing answers at."""
    temp = Path(tempfile.mkdtemp(prefix="dew-rt-", dir="/tmp"))  # short: Ray's sockets are paths under it
    (temp / "ray").mkdir()
    dead = f"127.0.0.1:{free_port()}"
    (temp / "ray" / "ray_current_cluster").write_text(dead)
    code = ("import ray\nfrom dew_ray.pipelines.run_dirs import start_ray\nstart_ray(None, 1)\n"
            "print('GCS', ray.get_runtime_context().gcs_address)\nray.shutdown()")
    try:  # an empty RAY_ADDRESS is no address, for start_ray and for Ray
        ran = run_python(code, env={"RAY_ADDRESS": "", "RAY_TMPDIR": str(temp)})
        started = ran.stdout.split("GCS ")[1].split()[0]
        assert started != dead and (temp / "ray" / "session_latest").exists()
    finally:
        shutil.rmtree(temp, ignore_errors=True)

TWO_TURNS = '''"""A user's environment factory for the pipeline test: one tool note after the first response, then the answer,
which the run's reward scores."""
from dew.collection.scoring import score_completion
from dew.records.episode_protocol import Environment, Observation


class TwoTurns(Environment):
    def __init__(self, prompt, note):
        self.prompt, self.note, self.turns = tuple(prompt), tuple(note), 0

    def reset(self):
        return Observation(self.prompt)

    def step(self, action):
        self.turns += 1
        after = action.context + action.tokens
        if self.turns == 1:
            return Observation(after + self.note, "running", "noted")
        return Observation(after, "completed", "answered")

    def metrics(self):
        return {"notes": float(min(self.turns, 1))}


def factory(setup):
    note = setup.tokenizer.encode("=note\\n", add_special_tokens=False)

    def environment(task, identity):
        return TwoTurns(task.data["prompt_ids"], note)

    def verifier(task, episode):  # the run's reward (here the judge) on the last response
        decode = lambda ids: setup.tokenizer.decode(ids, skip_special_tokens=True)
        return score_completion(setup.reward, decode, episode.transitions[-1].action.tokens, setup.eos_ids,
                                task.data)

    return environment, verifier
'''


def test_environment_and_judge_fields_are_checked_before_any_work(tmp_path, parity_judge):
    from dew.recipes.rlvr_plan import PlanError, plan_run

    with pytest.raises(ValueError, match="reward' = \"judge\" needs 'judge_model'"):
        load_config(None, ["reward=judge"])
    with pytest.raises(ValueError, match="and 'judge_model' needs reward = \"judge\""):
        load_config(None, [f"judge_model={parity_judge}"])
    with pytest.raises(ValueError, match="'judge_template' must name \\{response\\}"):
        load_config(None, ["reward=judge", f"judge_model={parity_judge}", "judge_template=Grade {prompt}"])
    judged = plan_run(load_config(None, ["reward=judge", f"judge_model={parity_judge}"]))
    assert judged.judge.model.vocab_size == 151936 and judged.judge_eos_ids == (151645,)
    assert f"reward: the judge Qwen3ForCausalLM from {parity_judge}" in judged.describe()
    with pytest.raises(PlanError, match="'judge_max_length' \\(4096\\) exceeds the judge's context"):
        plan_run(load_config(None, ["reward=judge", f"judge_model={parity_judge}", "judge_max_length=4096"]))
    with pytest.raises(PlanError, match="config field 'judge_parser' \\('nowhere:read'\\): no module"):
        plan_run(load_config(None, ["reward=judge", f"judge_model={parity_judge}", "judge_parser=nowhere:read"]))
    assert load_config(None, ["reward=judge", f"judge_model={parity_judge}"]).cpu_demand()["judge servers"] == 1

    with pytest.raises(ValueError, match="'environment' needs engine='native'"):
        load_config(None, ["environment=calculator", "engine=vllm"])
    with pytest.raises(ValueError, match="'max_turns' and 'max_context_tokens' need 'environment'"):
        load_config(None, ["max_turns=3"])
    plan = plan_run(load_config(None, ["environment=calculator", "max_turns=3"]))
    # a model call reads the prompt, two earlier responses and two tool results: the row holds it and one response
    assert plan.context_tokens == plan.prompt_len + 2 * 2 * 32 and plan.width == plan.context_tokens + 32
    assert "environment: calculator, model calls read at most" in "\n".join(plan.describe())
    assert plan_run(load_config(None, ["environment=calculator", "max_context_tokens=60"])).width == 92
    with pytest.raises(PlanError, match="'max_context_tokens' \\(20\\) is shorter than the longest prompt"):
        plan_run(load_config(None, ["environment=calculator", "max_context_tokens=20"]))
    with pytest.raises(PlanError, match="config field 'environment' \\('missing.py:factory'\\): .* is not a file"):
        plan_run(load_config(None, ["environment=missing.py:factory"]))


@pytest.mark.ray
@pytest.mark.slow
def test_the_pipeline_runs_a_users_multi_turn_environment_scored_by_a_model_judge(tmp_path):
    factory = tmp_path / "two_turns.py"
    factory.write_text(TWO_TURNS)
    # A judge whose verdict is known in advance: yes ("是") when its prompt's last id is even, no ("否") when odd.
    # The built-in policy writes ASCII only, so no judge prompt ends in a verdict's own id.
    judge = make_parity_judge(tmp_path / "judge", even="是", odd="否")
    (tmp_path / "verdicts.py").write_text('def verdict(reply):\n    return {"是": 1.0, "否": 0.0}[reply.strip()]\n')
    template = "{prompt} => {response}"
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        run = tmp_path / "run"
        # the driver API on a user's factory, named by file path, over two environment workers; the judge on a
        # judge server of its own, its replies read by a parser of the user's
        with RLVRPipeline(tiny(run, steps=2, environment=f"{factory}:factory", environment_workers=2,
                               environment_cpus=0.25, server_cpus=0.5, reward="judge", judge_model=str(judge),
                               judge_template=template, judge_chat_template=False, judge_cpus=0.25,
                               judge_parser=f"{tmp_path / 'verdicts.py'}:verdict", eval_samples=2, verl_rows=True,
                               slots=8)) as pipeline:
            pipeline.start()
            assert len(pipeline.actors.environment_workers) == 2 and len(pipeline.actors.judge_pool.servers) == 1
            pipeline.step(2)
            summary = pipeline.finish()
    finally:
        ray.shutdown()
    policy = task_tokenizer()
    judged = load_tokenizer(judge)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:  # per-turn metrics: turns, truncations and the environment's own numbers
        assert 1 <= line["rollout/episode/turns"] <= line["rollout/episode/turns_max"] <= 2
        assert 0 <= line["rollout/episode/truncated"] < 1 and line["rollout/episode/notes"] == 1.0
    note = task_tokenizer().encode("=note\n", add_special_tokens=False)
    two_call = 0
    for line in lines:  # the verl rows carry every call of a session
        rows = [json.loads(text) for text in
                (run / "verl_rows" / f"update-{line['step']:06d}.jsonl").read_text().splitlines()]
        trajectories = from_verl(rows)
        assert to_verl(trajectories) == rows
        sessions = [t.session for t in trajectories]
        assert {s.task.id for s in sessions} == set(line["tasks"]) and len(sessions) == 2 * 4
        for session in sessions:
            assert 1 <= len(session.calls) <= 2
            # the judge's verdict on the last response, as the environment's verifier asked for it
            prompt = policy.decode(session.calls[0].prompt_ids, skip_special_tokens=True)
            response = policy.decode(completion_ids(session.calls[-1].sampled_ids, {policy.eos_token_id}),
                                     skip_special_tokens=True)
            last = judged.encode(template.format(prompt=prompt, response=response), add_special_tokens=False)[-1]
            assert session.reward == float(last % 2 == 0)
            if len(session.calls) == 2:
                first, second = session.calls
                assert list(second.prompt_ids) == [*first.prompt_ids, *first.sampled_ids, *note]
                two_call += 1
    assert two_call
    # the held-out measure ran the same episodes on the built-in held-out split
    assert set(summary["reward_before"]) == {"all", "stderr", "math", "code", "pass@2", "pass@2/math", "pass@2/code"}
    assert 0 <= summary["reward_after"]["all"] <= 1


@pytest.mark.ray
@pytest.mark.slow
def test_dew_ray_rlvr_runs_from_a_users_own_folder_both_ways(tmp_path):
    """A user's folder with ``my.toml`` and the reward file beside it, outside the project: ``uv run --project``
    from there, and dew-ray installed into an environment of the user's own (``uv pip install`` of the project).
    Ray's workers get what they need either way: the local cluster's workers run the driver's interpreter (no
    working directory is packaged, so Ray's uv hook cannot refuse a project outside it, as it did)."""
    folder = tmp_path / "my-run"
    folder.mkdir()
    (folder / "rewards.py").write_text("def score(data_source, completion, ground_truth, extra_info):\n"
                                       "    return float(len(completion) % 2)\n")
    (folder / "my.toml").write_text("[rlvr]\nsteps = 2\nsft_steps = 10\ntasks_per_step = 2\nsamples = 4\n"
                                    "max_new_tokens = 40\neval_tasks = 4\neval_samples = 1\ntrain_tasks = 100\n"
                                    'runner = "process"\nprogress = false\nreward = "rewards.py:score"\n')
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    own = tmp_path / "own-env"
    # the lock's versions (a user's `pip install` resolves its own), then the project itself
    made = subprocess.run(f"uv export --quiet --frozen --no-dev --no-emit-project --project {ROOT} > {tmp_path}/pins.txt"
                          f" && uv venv --quiet --python {sys.executable} {own}"
                          f" && uv pip install --quiet --python {own}/bin/python -r {tmp_path}/pins.txt"
                          f" && uv pip install --quiet --no-deps --python {own}/bin/python {ROOT}", shell=True,
                          env=env, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    for name, command in (("uv run --project", ["uv", "run", "--project", str(ROOT), "dew-ray"]),
                          ("installed", [str(own / "bin" / "dew-ray")])):
        ran = subprocess.run([*command, "rlvr", "--config", "my.toml", "--set", f"run_dir=runs/{name.split()[0]}"],
                             cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        assert ran.returncode == 0, (name, ran.stdout[-3000:], ran.stderr[-3000:])
        summary = json.loads((folder / "runs" / name.split()[0] / "summary.json").read_text())
        assert summary["steps"] == 2, name
        assert not list(folder.glob("**/_ray_pkg_*")) and "not in the working_dir" not in ran.stderr
        # restartable roles are built from arguments kept by name: Ray has no line about losing them to print
        assert "has constructor arguments in the object store" not in ran.stderr, ran.stderr[-3000:]
