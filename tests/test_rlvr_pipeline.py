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
import urllib.request
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")

from conftest import ROOT, free_port  # noqa: E402

from dew_ray.pipelines.rlvr import RLVRPipeline, RLVRPipelineConfig, load_config  # noqa: E402

# Small enough for a couple of minutes on 2 cores; the warm start is short, so rewards stay near zero here.
TINY = ["steps=3", "sft_steps=10", "tasks_per_step=2", "samples=4", "max_new_tokens=40", "eval_tasks=4",
        "eval_samples=1", "train_tasks=100", "checkpoint_every=1", "runner=process", "progress=false"]


def tiny(run_dir, **values):
    return load_config(None, TINY, run_dir=str(run_dir), **values)


def test_config_file_overrides_and_named_errors(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[rlvr]\nsteps = 7\nservers = 2\nprompts = "none.jsonl"\n')
    with pytest.raises(ValueError, match="'prompts' names 'none.jsonl', which is not a file"):
        load_config(path)
    path.write_text('[rlvr]\nsteps = 7\nservers = 2\n')
    config = load_config(path, ["max_lag=2", "ahead=2", "learning_rate=3e-4", "progress=no"])
    assert (config.steps, config.servers, config.max_lag, config.ahead, config.progress) == (7, 2, 2, 2, False)
    assert config.learning_rate == 3e-4
    with pytest.raises(ValueError, match="unknown config field 'stepz'"):
        load_config(None, ["stepz=3"])
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
def test_the_driver_api_runs_a_pipeline_and_the_dashboard_series_are_exported(tmp_path):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, _metrics_export_port=port, log_to_driver=False,
             configure_logging=False)
    try:
        # two trainer processes (one jax.distributed job), each scheduling its own task of every batch
        with RLVRPipeline(tiny(tmp_path / "run", trainers=2, trainer_cpus=0.5)) as pipeline:
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
    assert set(summary["reward_after"]) == {"all", "math", "code"}
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert (run / "rlvr.png").stat().st_size > 10_000 and (run / "summary.json").exists()
    from dew.data.verifiable import task_tokenizer
    from dew.models.pretrained import Pretrained

    policy = Pretrained.from_directory(run / "policy")  # the final policy reads back from the Hugging Face layout
    variables = policy.load()
    assert policy.model().vocab_size == len(task_tokenizer()) and (run / "policy" / "tokenizer.json").exists()
    assert variables["params"]["embed_tokens"]["embedding"].shape[0] == len(task_tokenizer())


def test_cluster_configs_are_valid_for_ray_and_kuberay():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    launcher = yaml.safe_load((ROOT / "cluster_configs" / "ray-cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)  # the schema that ships inside the ray package
    validate_config(prepare_config(launcher))  # and with the launcher's defaults filled in, as `ray up` does
    assert any("uv sync" in command for command in launcher["setup_commands"])

    job = yaml.safe_load((ROOT / "cluster_configs" / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    entrypoint = job["spec"]["entrypoint"].split()
    assert entrypoint[:3] == ["python", "-m", "dew_ray.pipelines.rlvr"]
    config_path = entrypoint[entrypoint.index("--config") + 1]
    config = load_config(ROOT / config_path, [item for i, item in enumerate(entrypoint) if entrypoint[i - 1] == "--set"])
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    cpus = [float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])]
    cpus += [float(group["rayStartParams"]["num-cpus"]) * group["maxReplicas"] for group in cluster["workerGroupSpecs"]]
    reserved = config.trainers * config.trainer_cpus + config.servers * config.server_cpus
    reserved += config.sandbox_runners * config.sandbox_cpus
    assert reserved <= sum(cpus)  # the job fits the cluster it asks for
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]["RAY_AUTH_MODE"] == "disabled"


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit_runs_the_pipeline_on_a_head_this_test_starts(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port, dashboard = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    ray_bin = str(Path(sys.executable).parent / "ray")
    # --block keeps the head's processes in this session, so the test stops exactly the head it started
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
                             "--num-cpus=3", "--include-dashboard=true", f"--temp-dir={temp}"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert head.poll() is None, head.stdout.read().decode()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the head's dashboard never answered"
                time.sleep(1)
        run_dir = tmp_path / "submitted"
        args = [f"--set={item}" for item in TINY] + [f"--set=run_dir={run_dir}"]
        submitted = subprocess.run(
            [ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", ".", "--",
             sys.executable, "-m", "dew_ray.pipelines.rlvr", *args],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
        )
        assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
        assert "succeeded" in submitted.stdout.lower() and "held-out reward" in submitted.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 3 and (run_dir / "policy" / "model.safetensors").exists()
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        finally:
            try:
                os.killpg(head.pid, signal.SIGKILL)  # anything the head left behind
            except ProcessLookupError:
                pass
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_driver_resumes_with_no_batch_lost_or_trained_twice(tmp_path):
    """Kills the driver process (SIGKILL, with its local Ray cluster) after its second update; reruns it on the
    same run directory and checks the metrics: updates 1..5 once each, each on its own batch of the stream."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "dew_ray.pipelines.rlvr", *[f"--set={item}" for item in TINY], "--set=steps=5"]
    run_dir = tmp_path / "run"
    driver = subprocess.Popen([*command, f"--set=run_dir={run_dir}"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and driver.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and everything it started
    driver.wait(60)
    killed_at = len(metrics.read_text().splitlines())
    assert 2 <= killed_at < 5, driver.stdout.read().decode()[-3000:]

    resumed = subprocess.run([*command, f"--set=run_dir={run_dir}"], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]

    tasks = [task for row in rows for task in row["tasks"]]
    assert len(tasks) == 10 and len(set(tasks)) == 10  # every batch of the one epoch-ordered stream, once each


def test_prompt_files_in_verl_rows_are_read_and_checked(tmp_path):
    from dew_ray.pipelines.rlvr_job import pipeline_reward as _reward
    from dew_ray.pipelines.rlvr_job import prompt_rows as _prompt_rows

    rows = [{"data_source": "openai/gsm8k", "prompt": "What is two plus two?",
             "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 0}},
            {"data_source": "dew/arithmetic", "prompt": "What is one plus one?",
             "reward_model": {"ground_truth": "2"}, "extra_info": {}}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(None, [f"prompts={path}"])
    assert _prompt_rows(config, []) == rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:1]), parquet)
    assert _prompt_rows(load_config(None, [f"prompts={parquet}"]), [])[0]["reward_model"]["ground_truth"] == "4"
    from dew.sandbox import ProcessRunner, SandboxFleet

    with SandboxFleet(ProcessRunner(), workers=1) as fleet:
        reward = _reward(fleet)  # a data source without a route of its own is graded as math
        assert reward("openai/gsm8k", "so \\boxed{4}", "4", "{}") == 1.0
        assert reward("openai/gsm8k", "\\boxed{5}", "4", "{}") == 0.0
    path.write_text(json.dumps({"data_source": "x", "prompt": "p", "reward_model": {}}) + "\n")
    with pytest.raises(ValueError, match="row 0 has no reward_model.ground_truth"):
        _prompt_rows(load_config(None, [f"prompts={path}"]), [])
