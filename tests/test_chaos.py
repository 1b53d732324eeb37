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
import random
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
# restarts=10, max_attempts=10: up to 3 faults after each update (per_update=3, bench/fault_schedule.py), node
# removals among them, restart each server of the two worker nodes several times in 24 updates and fail a sample's
# draws (and a sandbox program's runs) more than the defaults (3 and 3) allow. Past them a server is dead for good
# ("of 4 started, 4 died", two clean-clone runs here) or a group is abandoned, as the spec's scheduler rule says
# (update 20 of another run: one group after 16 failed draws). The invariants below ask that nothing be lost within
# those budgets, as bench/chaos.py's several-node runs set them (restarts=10). Faults came on a clock (one every
# 1.5 s) until 12-07: a busier machine then met more of them in each update, and a run here lost its driver at
# update 6 after six node removals (a held-out program's runner lost three times, past the sandbox's 2 reruns), as
# did one whose schedule saved up the faults of the updates a stall spanned.
TINY = ["sft_steps=80", "sft_errors=0", "tasks_per_step=2", "samples=4", "max_new_tokens=40", "eval_tasks=4",
        "eval_samples=1", "train_tasks=100", "checkpoint_every=1", "runner=process", "beta=0", "restarts=10",
        "max_attempts=10"]
FIRST = ["remove node", "ray.kill trainer", "SIGSTOP rollout server past its timeout", "fleet add", "fleet remove"]


@pytest.mark.ray
@pytest.mark.slow
def test_the_pipeline_finishes_under_faults_and_keeps_its_invariants(tmp_path):
    result = chaos.chaos_run(tmp_path / "chaos", steps=24, seed=5, every=None, per_update=3,
                             options=[*TINY, "servers_max=4"], server_timeout=5, nodes=2, trainer_kills=1, first=FIRST)
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


def test_a_schedule_per_update_gives_no_update_more_faults_however_slow_the_machine():
    """The tests' chaos runs inject faults after each update (bench/fault_schedule.py), not on a clock: an update
    meets at most ``per_update`` of them however long it takes, so restart and retry budgets hold on any machine."""
    schedule_of = import_from("bench", "fault_schedule").FaultSchedule
    now = [0.0]
    schedule = schedule_of(random.Random(0), per_update=2, retry=1.0, clock=lambda: now[0])
    schedule.start(3)  # a resumed driver: its start is spared until it trains an update
    assert not schedule.due(3)
    now[0] += 10 ** 4  # however long an update takes
    assert not schedule.due(3)
    for _ in range(2):  # update 4 gets two, and no more however long it lasts
        assert schedule.due(4)
        schedule.tried(True)
    now[0] += 10 ** 4
    assert not schedule.due(4)
    assert schedule.due(6)  # a blocking fault spanned update 5: update 6 gets its own two, none saved up from 5
    schedule.tried(False)  # could not be injected now: tried again a second later
    assert not schedule.due(6)
    now[0] += 1.0
    assert schedule.due(6)
    schedule.tried(True)
    assert schedule.due(6)
    schedule.tried(True)
    assert not schedule.due(6) and schedule.due(7)
    scripted, asked = ["remove node", "fleet add"], []
    outcomes = iter([None, "remove node", "ray.kill trainer"])  # the first try fails now: retried, still first
    inject = lambda kind: (asked.append(kind), next(outcomes))[1]  # noqa: E731
    for _ in range(2):
        schedule.poll(8, inject, scripted)
        now[0] += 1.0
    assert asked == ["remove node", "remove node"] and scripted == ["fleet add"]
    with pytest.raises(ValueError, match="one of every"):
        schedule_of(random.Random(0), every=1.5, per_update=2)
    with pytest.raises(ValueError, match="per_update must be at least 1"):
        schedule_of(random.Random(0), per_update=0)
    clock = schedule_of(random.Random(0), every=2.0, clock=lambda: now[0])  # the bench's clock mode
    clock.start(0)
    assert not clock.due(1)  # 1 to 4 s after the driver's start
    now[0] += 4.0
    assert clock.due(1) and not clock.due(0)
    clock.tried(False)
    assert not clock.due(1)


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
    result = episodes.episode_chaos(steps=20, seed=2, every=None, per_update=3, server_timeout=4,
                                    first=["SIGKILL tool process", "ray.kill environment worker",
                                           "SIGSTOP rollout server past its timeout"])
    failed = {name: verdict["detail"] for name, verdict in result["invariants"].items() if not verdict["ok"]}
    assert not failed, (failed, result["log"])
    assert all(result["faults"].get(kind) for kind in ("SIGKILL tool process", "ray.kill environment worker",
                                                       "SIGSTOP rollout server past its timeout")), result["log"]
