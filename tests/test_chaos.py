"""The RLVR pipeline under seeded faults (bench/chaos.py at a test's size) on a simulated multi-node cluster (a Ray
head and two worker raylets, ``ray start``, the rollout servers and sandbox runners spread over the workers): actors
killed with ray.kill and SIGKILL, a whole worker node lost (a fresh one joins), the trainer actor killed (the driver
restarts the run's actors from the last checkpoint), a rollout server stalled with SIGSTOP (briefly, and once past the
pools' server_timeout, so its replies are lost while it lives), sandbox programs killed, the driver SIGKILLed once and
run again, and rollout servers added and removed by requests to the driver (dew-ray fleet's). The run must finish, and
every invariant read back from its run directory must hold. Then tool episodes (bench/chaos_episodes.py) with their
environment workers and tool processes killed. (vLLM engines' stalls and kills are tests/test_multinode.py's and
tests/test_rollout_servers.py's, and bench/chaos.py's with ``--engine vllm``: an engine start costs a minute here.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import import_from

chaos = import_from("bench", "chaos")
# 80 warm-start steps from a teacher without slips leave groups of mixed rewards, so the updates move the policy and
# the replay below has something to reproduce
# beta=0: no KL term, as the run had before it became the default. With beta=0.1 the run failed twice on a 2-core
# Intel Xeon (once from a removed placement group, which the pools and the broadcast now treat as a dead actor; once
# for a cause the test did not keep: it keeps each driver's output in the run directory now).
# restarts=10, max_attempts=10: a fault every 1.5 s, node removals among them, restarts each server of the two
# worker nodes several times in 24 updates and fails a sample's draws more than the defaults (3 and 3) allow. Past
# them a server is dead for good ("of 4 started, 4 died", two clean-clone runs here) or a group is abandoned, as the
# spec's scheduler rule says (update 20 of another run: one group after 16 failed draws). The invariants below ask
# that nothing be lost within those budgets, as bench/chaos.py's several-node runs set them (restarts=10).
TINY = ["sft_steps=80", "sft_errors=0", "tasks_per_step=2", "samples=4", "max_new_tokens=40", "eval_tasks=4",
        "eval_samples=1", "train_tasks=100", "checkpoint_every=1", "runner=process", "beta=0", "restarts=10",
        "max_attempts=10"]
FIRST = ["remove node", "ray.kill trainer", "SIGSTOP rollout server past its timeout", "fleet add", "fleet remove"]


@pytest.mark.ray
@pytest.mark.slow
def test_the_pipeline_finishes_under_faults_and_keeps_its_invariants(tmp_path):
    result = chaos.chaos_run(tmp_path / "chaos", steps=24, seed=5, every=1.5, options=[*TINY, "servers_max=4"],
                             server_timeout=5, nodes=2, trainer_kills=1, first=FIRST)
    failed = {name: verdict["detail"] for name, verdict in result["invariants"].items() if not verdict["ok"]}
    assert not failed, (failed, result["log"], result["last_output"])
    assert result["faults"].get("SIGKILL driver") == 1 and result["driver_runs"] == 2
    assert all(result["faults"].get(kind) for kind in FIRST), result["log"]
    assert result["recoveries"] >= 1, result["last_output"]  # the lost trainer's run went on in its driver
    assert "fleet requests answered" in result["invariants"], result["log"]
    assert any(change["change"] == "add" and change.get("request") for change in result["fleet"]), result["fleet"]
    # what the run trained on was recorded through the kills, resubmissions and restarts: trained again from the
    # record, without Ray, servers or sandboxes, it reaches the same parameters after every update
    rows = [json.loads(line) for line in (tmp_path / "chaos" / "metrics.jsonl").read_text().splitlines()]
    assert any(row["train/loss"] != 0 for row in rows) and sum(row["train/record/bytes"] for row in rows) > 0
    replayed = subprocess.run([str(Path(sys.executable).parent / "dew-ray"), "replay", str(tmp_path / "chaos")],
                              capture_output=True, text=True, timeout=600)
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    assert "replayed 24 steps" in replayed.stdout and "DIFFERENT" not in replayed.stdout, replayed.stdout


def test_the_sandbox_never_reports_a_killed_program_completed():
    result = chaos.sandbox_chaos(programs=40, seed=3)
    assert result["killed"] > 0 and result["killed_reported_completed"] == [], result
    assert result["verdicts"].get("crashed", 0) >= result["killed"]


@pytest.mark.ray
@pytest.mark.slow
def test_tool_episodes_train_under_faults_to_environment_actors_and_tool_processes(cluster):
    """bench/chaos_episodes.py at a test's size: environment workers killed, tool processes SIGKILLed mid-session,
    rollout servers stopped (briefly and past the pools' timeout) and killed while GRPO trains through them."""
    episodes = import_from("bench", "chaos_episodes")
    result = episodes.episode_chaos(steps=20, seed=2, every=0.7, server_timeout=4,
                                    first=["SIGKILL tool process", "ray.kill environment worker",
                                           "SIGSTOP rollout server past its timeout"])
    failed = {name: verdict["detail"] for name, verdict in result["invariants"].items() if not verdict["ok"]}
    assert not failed, (failed, result["log"])
    assert all(result["faults"].get(kind) for kind in ("SIGKILL tool process", "ray.kill environment worker",
                                                       "SIGSTOP rollout server past its timeout")), result["log"]
