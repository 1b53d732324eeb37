"""SubprocessEnvironment against a real worker (tests/workers/square_worker.py) and the episode protocol types.

Round trips with exact contexts, snapshots, and every way a worker can fail: a hang, the
memory limit, a signal, a non-zero exit, output that is not the protocol, the parent's
death and a grandchild left behind. Deadlines are 1-2 s.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ScriptedPolicy

from dew.collection.episode_rollout import EpisodeRollout
from dew.records.episode_protocol import (
    Action,
    Environment,
    EnvironmentFailure,
    Episode,
    EpisodeId,
    EpisodeStatus,
    Observation,
    Transition,
)
from dew.sandbox import SandboxLimits, SubprocessEnvironment

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).resolve().parent / "workers" / "square_worker.py")
LIMITS = SandboxLimits(wall_seconds=2.0, memory_bytes=256 << 20, message_bytes=4096)
EPISODE = EpisodeId(task=3, step=1, sample=2, seed=99)
BOS, TOOL, EOS = 1, 3, 2


def worker(*args: str, limits: SandboxLimits = LIMITS) -> SubprocessEnvironment:
    return SubprocessEnvironment([sys.executable, WORKER, *args], limits)


def answer(observation: Observation, *tokens: int, policy_step: int = 0) -> Action:
    return Action(observation.context, tokens, eos=tokens[-1:] == (EOS,), policy_step=policy_step)


def marked(marker: str) -> list[int]:
    """Live processes with ``marker`` among their arguments (a zombie's cmdline is empty)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                if marker.encode() in file.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def wait_until(condition, seconds: float = 5.0) -> bool:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# -- round trips ------------------------------------------------------------------------------


def test_round_trip_with_exact_contexts_until_completion():
    with worker("--turns", "3")(EPISODE) as env:
        directory = env.directory
        assert os.path.isdir(directory)
        first = env.reset()
        # reset: [BOS, 10 + task]; the worker saw the whole episode identity
        assert first == Observation((BOS, 13), "running", "task=3 step=1 sample=2 seed=99")
        second = env.step(answer(first, 4, EOS, policy_step=5))
        # the action appended, then [TOOL, 4 * 4]
        assert second.context == (BOS, 13, 4, EOS, TOOL, 16)
        assert second.status is EpisodeStatus.RUNNING and second.detail == "square(4) = 16 at policy step 5"
        third = env.step(answer(second, 5, EOS))
        assert third.context == (BOS, 13, 4, EOS, TOOL, 16, 5, EOS, TOOL, 25)
        last = env.step(answer(third, 7, EOS))
        assert last == Observation((*third.context, 7, EOS), EpisodeStatus.COMPLETED, "answer 7 eos=True")
        assert last.terminal and env.failure is None
    assert not os.path.exists(directory)


def test_a_worker_reported_error_keeps_the_worker():
    with worker()(EPISODE) as env:
        first = env.reset()
        wrong = env.step(Action((BOS, 99), (4, EOS), eos=True, policy_step=0))
        assert wrong == Observation((), "error", "context mismatch")
        assert env.failure is None
        assert env.step(answer(first, 4, EOS)).context == (BOS, 13, 4, EOS, TOOL, 16)


def test_snapshot_round_trip_continues_identically():
    factory = worker("--turns", "3")
    with factory(EPISODE) as original:
        after_one = original.step(answer(original.reset(), 4, EOS))
        snapshot = original.get_state()
        assert isinstance(snapshot, bytes)
        expected = original.step(answer(after_one, 6, EOS))
    with factory(EPISODE) as restored:
        assert restored.set_state(snapshot) is None  # the worker acknowledged {"restored": true}
        assert restored.step(answer(after_one, 6, EOS)) == expected
        assert expected.context == (*after_one.context, 6, EOS, TOOL, 36)


def test_environment_snapshots_are_optional():
    class Plain(Environment):
        def reset(self):
            return Observation((BOS,))

        def step(self, action):
            return Observation((), "completed")

    with Plain() as env:
        assert env.reset() == Observation((BOS,))
        with pytest.raises(NotImplementedError, match="journaled"):
            env.get_state()
        with pytest.raises(NotImplementedError, match="journaled"):
            env.set_state(b"")


# -- failures ---------------------------------------------------------------------------------


def test_a_hang_ends_the_episode_at_the_deadline():
    limits = SandboxLimits(wall_seconds=1.0, memory_bytes=256 << 20)
    with worker("--fail", "hang", limits=limits)(EPISODE) as env:
        first = env.reset()
        started = time.monotonic()
        observation = env.step(answer(first, 4, EOS))
        assert time.monotonic() - started < 2.0
        assert observation.status is EpisodeStatus.ERROR and observation.context == ()
        assert "worker timed out after 1 s" in observation.detail
        assert env.step(answer(first, 4, EOS)) is observation  # dead: the same observation again
        assert env.reset() is observation
        with pytest.raises(EnvironmentFailure, match="get_state failed .* timed out"):
            env.get_state()


def test_the_memory_limit_ends_the_episode():
    with worker("--fail", "memory")(EPISODE) as env:
        observation = env.step(answer(env.reset(), 4, EOS))
    assert observation.status is EpisodeStatus.ERROR
    assert "worker exited with status 1" in observation.detail and "MemoryError" in observation.detail


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("signal", "worker exited with signal 9 (SIGKILL)"),
        ("exit", "worker exited with status 3; stderr: square worker: giving up"),
    ],
)
def test_a_crash_is_named(kind, expected):
    with worker("--fail", kind)(EPISODE) as env:
        observation = env.step(answer(env.reset(), 4, EOS))
    assert observation.status is EpisodeStatus.ERROR and observation.detail == expected


def test_a_missing_command_is_an_error_observation():
    with SubprocessEnvironment(["/nonexistent/dew-worker"], LIMITS)(EPISODE) as env:
        observation = env.reset()
    assert observation.status is EpisodeStatus.ERROR
    assert observation.detail.startswith("worker exited with status")
    assert "/nonexistent/dew-worker" in observation.detail  # prlimit's message on stderr


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("not_json", "malformed reply to step: not JSON"),
        ("array", "malformed reply to step: not a JSON object"),
        ("oversized", "a reply line longer than limits.message_bytes=4096"),
        ("endless", "a reply line longer than limits.message_bytes=4096"),
        ("negative", "Observation.context[1] must be a non-negative integer token id (not a bool), got -4"),
        ("boolean", "Observation.context[1] must be a non-negative integer token id (not a bool), got True"),
        ("missing", "the reply lacks ['context']"),
        ("bad_status", "Observation.status must be one of"),
    ],
)
def test_malformed_output_is_an_error_observation(kind, expected):
    with worker("--fail", kind)(EPISODE) as env:
        started = time.monotonic()
        observation = env.step(answer(env.reset(), 4, EOS))
        assert time.monotonic() - started < 1.0  # caught as it arrives, not at the deadline
    assert observation.status is EpisodeStatus.ERROR
    assert expected in observation.detail


def test_a_second_reply_line_is_a_protocol_error():
    with worker("--fail", "two_lines")(EPISODE) as env:
        first = env.reset()
        assert env.step(answer(first, 4, EOS)).context == (1, 2)
        time.sleep(0.2)  # the second line arrives
        observation = env.step(answer(first, 4, EOS))
    assert observation.status is EpisodeStatus.ERROR
    assert observation.detail.startswith("protocol error: the worker wrote to stdout outside a reply")


def test_snapshot_failures_raise():
    with worker("--fail", "bad_state")(EPISODE) as env:
        env.reset()
        with pytest.raises(EnvironmentFailure, match="get_state failed .* malformed reply to get_state"):
            env.get_state()
        assert env.failure is not None  # the worker was killed with it
    with worker()(EPISODE) as env:
        # not a snapshot of this worker's: it crashes on it instead of acknowledging
        with pytest.raises(EnvironmentFailure, match=r"(?s)set_state failed .*: worker exited with status 1; stderr: .*"
                                                     r"JSONDecodeError"):
            env.set_state(b"anything")


# -- process lifetime -------------------------------------------------------------------------


def test_exit_kills_the_process_group_and_removes_the_directory():
    marker = f"dew-test-{uuid.uuid4().hex}"
    with pytest.raises(KeyError), worker("--spawn", "--marker", marker)(EPISODE) as env:
        env.reset()
        directory = env.directory
        assert wait_until(lambda: len(marked(marker)) == 2)  # the worker and its grandchild
        raise KeyError("the caller fails")
    assert wait_until(lambda: not marked(marker))
    assert not os.path.exists(directory)


def test_the_worker_dies_with_its_parent():
    marker = f"dew-test-{uuid.uuid4().hex}"
    code = f"""
import sys, time
from dew.records.episode_protocol import EpisodeId
from dew.sandbox import SandboxLimits, SubprocessEnvironment
factory = SubprocessEnvironment([sys.executable, {WORKER!r}, "--marker", {marker!r}], SandboxLimits(wall_seconds=60))
with factory(EpisodeId(0, 0, 0, 0)) as env:
    env.reset()
    print("ready", flush=True)
    time.sleep(60)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT, env=env)
    try:
        assert parent.stdout.readline() == b"ready\n"
        [pid] = marked(marker)
        directory = os.readlink(f"/proc/{pid}/cwd")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until(lambda: not marked(marker))
        # A parent killed outright cannot remove the worker's directory; that is left to the caller.
        assert Path(directory).name.startswith("dew-episode-")
        shutil.rmtree(directory)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


# -- protocol types ---------------------------------------------------------------------------


def test_observation_validation():
    observation = Observation([1, np.int64(2)], "completed", "done")
    assert observation.context == (1, 2) and type(observation.context[1]) is int
    assert observation.status is EpisodeStatus.COMPLETED
    assert Observation((), "truncated").terminal and not Observation((1,)).terminal
    with pytest.raises(ValueError, match=r"Observation.context\[0\] must be a non-negative integer .* got True"):
        Observation((True,))
    with pytest.raises(ValueError, match="got -1"):
        Observation((1, -1))
    with pytest.raises(ValueError, match="got 1.0"):
        Observation((1.0,))
    with pytest.raises(ValueError, match="Observation.context must hold at least one token id"):
        Observation(())  # running needs the next context
    with pytest.raises(ValueError, match="ordered sequence of token ids, got str"):
        Observation("12")
    with pytest.raises(ValueError, match=r"Observation.status must be one of \['running', 'completed', 'truncated', "
                                         r"'cancelled', 'error'\], got 'done'"):
        Observation((1,), "done")
    with pytest.raises(ValueError, match="detail must be a string"):
        Observation((1,), "running", None)


def test_action_validation():
    action = Action([1, 2], np.array([5, EOS]), eos=True, policy_step=3)
    assert action.context == (1, 2) and action.tokens == (5, EOS)
    assert Action((1,), (), eos=False, policy_step=0).tokens == ()  # cut off before its first token
    with pytest.raises(ValueError, match="Action.context must hold at least one token id"):
        Action((), (5,), eos=False, policy_step=0)
    with pytest.raises(ValueError, match=r"Action.tokens\[1\] .* got False"):
        Action((1,), (5, False), eos=False, policy_step=0)
    with pytest.raises(ValueError, match="Action.eos must be a bool, got 1"):
        Action((1,), (5,), eos=1, policy_step=0)
    with pytest.raises(ValueError, match="Action.tokens is empty"):
        Action((1,), (), eos=True, policy_step=0)
    with pytest.raises(ValueError, match="Action.policy_step must be an integer >= -1, got -2"):
        Action((1,), (5,), eos=False, policy_step=-2)  # -1 is a server's version before the first push


def test_episode_and_id_validation():
    with pytest.raises(ValueError, match="EpisodeId.sample must be a non-negative integer, got -1"):
        EpisodeId(task=0, step=0, sample=-1, seed=0)
    with pytest.raises(ValueError, match="EpisodeId.task must be a non-negative integer, got True"):
        EpisodeId(task=True, step=0, sample=0, seed=0)
    assert EpisodeId(0, 0, 0, seed=-7).seed == -7
    reset = Observation((BOS, 13), detail="start")
    episode = Episode(EPISODE, reset)
    assert episode.status is EpisodeStatus.RUNNING and episode.detail == "start"
    episode.transitions.append(Transition(answer(reset, 7, EOS), Observation((), "truncated", "out of turns")))
    assert episode.status is EpisodeStatus.TRUNCATED and episode.detail == "out of turns"
    with pytest.raises(ValueError, match="Transition.observation must be an Observation, got tuple"):
        Transition(answer(reset, 7, EOS), (1, 2))
    with pytest.raises(ValueError, match=r"Episode.transitions\[0\] must be a Transition"):
        Episode(EPISODE, reset, [reset])


def test_factory_validation():
    with pytest.raises(ValueError, match="command must be a non-empty sequence of strings"):
        SubprocessEnvironment("python worker.py")
    with pytest.raises(ValueError, match="limits must be a SandboxLimits"):
        SubprocessEnvironment(["python"], limits={"wall_seconds": 1})
    with pytest.raises(ValueError, match="episode must be an EpisodeId"):
        SubprocessEnvironment(["python"])((0, 0, 0, 0))
    closed = SubprocessEnvironment(["python"])(EPISODE)
    closed.close()
    with pytest.raises(RuntimeError, match="is closed"):
        closed.reset()


# -- a whole EpisodeRollout cohort through real workers -----------------------------------------


def test_an_episode_rollout_cohort_runs_through_real_workers():
    marker = f"dew-cohort-{uuid.uuid4().hex}"
    factory = SubprocessEnvironment([sys.executable, WORKER, "--turns", "2", "--marker", marker],
                                    SandboxLimits(wall_seconds=30))
    policy = ScriptedPolicy(lambda context: [2 + len(context) % 3], EOS)  # calls square(n), then answers

    def verifier(episode):
        return float(episode.status is EpisodeStatus.COMPLETED and episode.detail.startswith("answer"))

    rollout = EpisodeRollout(policy, factory, verifier, max_prompt_tokens=8, max_new_tokens=2, max_turns=3, groups=2)
    records = rollout.collect({"task_id": np.array([3, 4], np.int32)}, None, 7, jax.random.key(0))
    assert [(r.episode.id.task, r.episode.id.sample) for r in records] == [(3, 0), (3, 1), (4, 0), (4, 1)]
    for record in records:
        (call, final) = record.episode.transitions
        n = call.action.tokens[0]
        assert call.observation.context == call.action.context + call.action.tokens + (TOOL, n * n)
        assert final.action.context == call.observation.context and record.reward == 1.0
        assert call.observation.detail == f"square({n}) = {n * n} at policy step 7"
    batch = rollout.project(records)
    assert int((batch["text_segment_ids"].max(axis=1) > 0).sum()) == 4  # one chain per episode: the contexts extend
    assert wait_until(lambda: not marked(marker))  # every worker's process group is gone
