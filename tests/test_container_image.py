"""The project's image (the repository's Dockerfile) builds and runs the main job inside a container.

The image is built by tools/container_env.py (``.ci/run`` builds it before the tests; here the build runs again and
Docker's layer cache makes it take seconds when nothing changed). The container gets no network but its own
loopback, which the job's local Ray cluster needs, and the two security options bubblewrap needs inside a container
(the Dockerfile and the cluster configs say the same).
"""

import json
import subprocess
import time

import pytest

BUBBLEWRAP_OPTIONS = ["--security-opt", "seccomp=unconfined", "--security-opt", "systempaths=unconfined"]


@pytest.mark.slow
def test_the_project_image_builds_and_runs_the_main_job_offline(container_engine, tmp_path):
    began = time.monotonic()
    container_engine.build_project()
    built = time.monotonic() - began
    image = container_engine.PROJECT_IMAGE
    size = int(subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True,
                              text=True, timeout=60, check=True).stdout)
    print(f"{image}: built in {built:.0f} s, {size / 2**30:.2f} GiB")
    assert container_engine.missing_step(project=True) is None  # `container_env.py check --project` says ready
    out = tmp_path / "out"
    out.mkdir()
    command = ["docker", "run", "--rm", "--network", "none", "--shm-size", "1g", *BUBBLEWRAP_OPTIONS,
               "--volume", f"{out}:/out", image,
               "dew-ray", "rlvr", "--steps", "2", "--run-dir", "/out/run",
               "--set", "sft_steps=10", "--set", "eval_tasks=4", "--set", "eval_samples=1", "--set", "tasks_per_step=4",
               "--set", "progress=false"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sandbox for code tasks: bubblewrap" in result.stdout  # the default runner, inside the container
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert (out / "run" / "policy" / "config.json").exists()
    assert "held-out reward" in result.stdout


def test_the_project_image_refuses_bubblewrap_without_the_options_and_says_which(container_engine):
    container_engine.build_project()
    probe = "from dew.sandbox import BwrapRunner\nBwrapRunner()"
    result = subprocess.run(["docker", "run", "--rm", "--network", "none", container_engine.PROJECT_IMAGE,
                             "python", "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "--security-opt seccomp=unconfined --security-opt systempaths=unconfined" in result.stderr
