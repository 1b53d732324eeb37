"""EpisodeJournal: a collection that died resumes where it stood; what it refuses.

The in-process tests abort a collection with an exception at a chosen tool call, as a
crash would leave it, and collect again with a fresh journal object on the same
directory. The last test SIGKILLs a real two-device training process while a subprocess
tool call is pending (tests/workers/recovery_worker.py), restarts it from its checkpoint
and its journal, and compares it with an uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT
from test_tool_episodes import EOS, NUM, SAMPLING, SQUARE, Harness, Scripted, square_then_answer, tasks, verify

from dew.collection.episode_rollout import EpisodeFailure
from dew.collection.journal import EpisodeJournal, JournalError
from dew.collection.episode_rollout import EpisodeRollout


def rollout(harness, journal, policy=None, **options):
    settings = {"max_prompt_tokens": 8, "max_new_tokens": 3, "max_turns": 3, "groups": 2, "sampling": SAMPLING}
    return EpisodeRollout(policy or Scripted(square_then_answer), harness, verify, journal=journal,
                          **{**settings, **options})


def summary(records):
    return [(r.episode.id, [(a.action, a.old_log_probs, a.behavior_log_probs) for a in r.actions],
             [t.observation for t in r.episode.transitions], r.reward) for r in records]


def steps(audit):
    return [entry[1:] for entry in audit if entry[0] == "step"]


def test_a_collection_that_died_mid_round_resumes_without_running_completed_tool_calls_again(tmp_path):
    whole = rollout(Harness(), None).collect(tasks(0, 1), None, 2, jax.random.key(3))
    crashing = Harness(fail_on_step=2, step_error=RuntimeError("the machine went down"))  # task 0, sample 1, turn 2
    first = EpisodeJournal(tmp_path / "episodes")
    with pytest.raises(EpisodeFailure):
        rollout(crashing, first).collect(tasks(0, 1), None, 2, jax.random.key(3))
    first.close()
    done_before = steps(crashing.audit)
    assert done_before[:4] == [(0, 0, (SQUARE, EOS)), (0, 1, (SQUARE, EOS)), (1, 0, (SQUARE, EOS)), (1, 1, (SQUARE, EOS))]
    policy = Scripted(square_then_answer)
    again = Harness()
    resumed = rollout(again, EpisodeJournal(tmp_path / "episodes"), policy=policy).collect(
        tasks(0, 1), None, 2, jax.random.key(3))
    assert summary(resumed) == summary(whole)
    # round 1's tool calls and task 0 sample 0's answer completed before the crash and are not called again;
    # the call that was pending when it died runs once more, with the draw the journal kept
    assert steps(again.audit) == [(0, 1, (NUM(1), EOS)), (1, 0, (NUM(4), EOS)), (1, 1, (NUM(4), EOS))]
    assert done_before[-1] == (0, 1, (NUM(1), EOS))
    assert policy.calls == []  # every draw of both rounds was in the journal
    assert all(any(e[0] == "restored" and e[1:3] == (env.identity.task, env.identity.sample) for e in again.audit)
               for env in again.opened)  # environments came back through set_state, not a second reset


def test_a_finished_collection_is_served_from_the_journal_and_a_new_clock_starts_afresh(tmp_path):
    journal = EpisodeJournal(tmp_path / "episodes")
    harness = Harness()
    first = rollout(harness, journal).collect(tasks(0), None, 0, jax.random.key(1))
    again = Harness()
    replay = rollout(again, journal).collect(tasks(0), None, 0, jax.random.key(1))  # the update never happened
    assert summary(replay) == summary(first) and steps(again.audit) == []
    later = Harness()
    rollout(later, journal).collect(tasks(0), None, 1, jax.random.key(2))
    assert len(steps(later.audit)) == 4


def test_recovery_refuses_what_does_not_match_and_a_second_writer(tmp_path):
    journal = EpisodeJournal(tmp_path / "episodes")
    with pytest.raises(EpisodeFailure):
        rollout(Harness(fail_on_step=1, step_error=RuntimeError("down")), journal).collect(
            tasks(0), None, 4, jax.random.key(9))
    with pytest.raises(JournalError, match=r"same training clocks \(update 4, step 4\) and key, made with different tasks"):
        rollout(Harness(), journal).collect(tasks(1), None, 4, jax.random.key(9))
    with pytest.raises(JournalError, match="made with different options"):
        rollout(Harness(), journal, max_new_tokens=2).collect(tasks(0), None, 4, jax.random.key(9))
    model_a, model_b = ({"w": np.ones(3, np.float32) * v} for v in (1, 2))
    rollout(Harness(), journal).collect(tasks(0), model_a, 5, jax.random.key(9))  # a finished collection at clock 5
    with pytest.raises(JournalError, match="made with different policy"):
        rollout(Harness(), journal).collect(tasks(0), model_b, 5, jax.random.key(9))
    with pytest.raises(JournalError, match="another process is writing the episode journal"):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            pool.apply(_open_journal, (str(tmp_path / "episodes"),))
    journal.close()


def _open_journal(directory):
    EpisodeJournal(directory)._open()


def test_environments_without_snapshots_cannot_be_journaled(tmp_path):
    class Plain(Harness):
        def __call__(self, identity):
            env = super().__call__(identity)
            env.get_state = lambda: (_ for _ in ()).throw(NotImplementedError("Plain does not implement get_state()"))
            return env

    with pytest.raises(EpisodeFailure) as caught:
        rollout(Plain(), EpisodeJournal(tmp_path / "episodes")).collect(tasks(0), None, 0, jax.random.key(0))
    assert "an EpisodeJournal needs environments that snapshot their state" in str(caught.value.__cause__)
    assert len(rollout(Plain(), None).collect(tasks(0), None, 0, jax.random.key(0))) == 2  # fine without a journal


RECOVERY = str(ROOT / "tests" / "workers" / "recovery_worker.py")
TWO_DEVICES = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def audit(run):
    return [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_training_process_killed_during_a_tool_call_resumes_to_the_same_actions_and_parameters(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for run in (whole, killed):
        run.mkdir()
    done = subprocess.run([sys.executable, RECOVERY, str(whole), str(whole / "out.json")], env=TWO_DEVICES, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marker = tmp_path / "paused"
    # task 5 is step 1's second task: its square call waits after task 4's calls completed
    trainer = subprocess.Popen([sys.executable, RECOVERY, str(killed), str(killed / "out.json"), f"5,1:{marker}"],
                               env=TWO_DEVICES, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while not marker.exists() and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), trainer.communicate(timeout=60)[0][-3000:]
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait(60)
    before = audit(killed)
    assert {(e["task"], e["step"]) for e in before} >= {(4, 1)} and not any(e["task"] == 5 for e in before)
    resumed = subprocess.run([sys.executable, RECOVERY, str(killed), str(killed / "out.json")], env=TWO_DEVICES,
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    want, got = (json.loads((run / "out.json").read_text()) for run in (whole, killed))
    assert got["updates"] == want["updates"] and got["step"] == want["step"] == 3
    assert got["collected"] == want["collected"][1:]  # the restarted run began at update 1's collection
    for a, b in zip(got["params"], want["params"], strict=True):
        np.testing.assert_array_equal(a, b)
    calls = [(e["task"], e["step"], e["sample"], e["turn"]) for e in audit(killed)]
    assert len(calls) == len(set(calls))  # each completed square call ran once
    assert sorted(calls) == sorted((e["task"], e["step"], e["sample"], e["turn"]) for e in audit(whole))
