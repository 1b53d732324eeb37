"""PromptSource and EnvironmentSource on a real NativeRolloutServer over a tiny decoder."""

import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.collection.sources import EnvironmentSource, PromptSource
from dew.records.episode_protocol import Environment, EpisodeId, EpisodeStatus, Observation
from dew.records.session_metrics import session_metrics
from dew.records.session_packing import chain_lengths, pack
from dew.records.session_records import Status, Task
from dew.sampling import Sampling
from dew.sandbox import SandboxLimits, SubprocessEnvironment

EOS = tuple(range(16))  # half the vocabulary ends a draw, so most draws stop within a few ids
TOOL_ID = 30  # what the counting tool appends after each turn


@pytest.fixture(scope="module")
def eos_server(sharp_decoder):
    model, variables = sharp_decoder
    serving = ServingTask(model, variables, Sampling(eos_id=EOS, temperature=1.0, top_k=8))
    with NativeRolloutServer(Server.from_task(serving, slots=4, capacity=64), version=2) as server:
        yield server


@pytest.fixture(scope="module")
def long_server(sharp_decoder):
    """No EOS: every draw runs to its budget unless cancelled."""
    model, variables = sharp_decoder
    serving = ServingTask(model, variables, Sampling(temperature=1.0, top_k=8))
    with NativeRolloutServer(Server.from_task(serving, slots=2, capacity=64)) as server:
        yield server


def wait_running(server, draw, ids=2, timeout=30.0):
    """Block until ``draw`` is in a slot with at least ``ids`` sampled ids, so a cancel lands mid-draw."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(a is not None and a.request == draw.request and len(a.ids) >= ids for a in server.server._active):
            return
        time.sleep(0.001)
    raise AssertionError("the draw never started")


# ----- PromptSource ---------------------------------------------------------------------------


def test_prompt_source_scores_off_the_server_thread_with_fixed_seeds(eos_server):
    threads = []

    def reward(data_source, completion, ground_truth, extra_info):
        threads.append(threading.current_thread().name)
        if ground_truth == "broken":
            raise RuntimeError("verifier down")
        if ground_truth == "nan":
            return math.nan
        assert data_source == "count" and extra_info == ""
        return float(len(completion.split()))

    with PromptSource(eos_server, reward, max_new_tokens=2, eos_ids=EOS, workers=2) as source:
        task = Task("t1", {"prompt_ids": [20, 21, 22], "ground_truth": "x", "data_source": "count"})
        sessions = [f.result(timeout=60) for f in source.submit(task, group=0, samples=8)]
        again = [f.result(timeout=60) for f in source.submit(task, group=0, samples=8)]
        other_group = [f.result(timeout=60) for f in source.submit(task, group=1, samples=8)]
        broken = source.submit(Task("t2", {"prompt_ids": [20, 21], "ground_truth": "broken"}), 0, 1)[0].result(60)
        nan = source.submit(Task("t3", {"prompt_ids": [20, 21], "ground_truth": "nan"}), 0, 1)[0].result(60)
        with pytest.raises(KeyError, match="no 'prompt_ids'"):
            source.submit(Task("t4", {}), 0, 1)
    with pytest.raises(RuntimeError, match="PromptSource is closed"):
        source.submit(task, 0, 1)

    assert threads and all(name.startswith("dew-prompt-score") for name in threads)  # never the server's thread
    assert [s.sample for s in sessions] == list(range(8))
    drawn = [s.calls[0].sampled_ids for s in sessions]
    assert drawn == [s.calls[0].sampled_ids for s in again]  # the seed is fixed by (task, group, sample)
    assert drawn != [s.calls[0].sampled_ids for s in other_group]
    statuses = set()
    for s in sessions:
        call = s.calls[0]
        stopped = call.finish_reason == "stop"
        assert stopped == (call.sampled_ids[-1] in EOS) and call.version == 2 and call.prompt_ids == [20, 21, 22]
        assert s.status is (Status.COMPLETED if stopped else Status.TRUNCATED)  # a budget-hit draw is scored too
        assert s.reward == len(call.sampled_ids) - stopped  # EOS left out of the reward's text
        statuses.add(s.status)
    assert statuses == {Status.COMPLETED, Status.TRUNCATED}
    assert broken.status is Status.INFRA_ERROR and "verifier down" in broken.detail and broken.reward is None
    assert nan.status is Status.INFRA_ERROR and "finite" in nan.detail
    batch = pack(sessions + [broken, nan], width=8, truncation="score")
    assert set(np.unique(batch["session_index"])) == {-1, *range(8)}  # the failures take no rows


def test_prompt_source_cancels_mid_draw(long_server):
    with PromptSource(long_server, lambda *fields: 1.0, max_new_tokens=55) as source:
        future = source.submit(Task("long", {"prompt_ids": [1, 2, 3]}), 0, 1)[0]
        wait_running(long_server, source._live[future].draw)
        source.cancel(future)
        session = future.result(timeout=60)
    call = session.calls[0]
    assert session.status is Status.CANCELLED and call.finish_reason == "cancelled"
    assert 2 <= len(call.sampled_ids) < 55 and session.reward is None


# ----- EnvironmentSource ----------------------------------------------------------------------


class CountingTool(Environment):
    """Each EOS turn appends TOOL_ID to the context; completes after ``turns`` turns.

    ``fail`` makes it misbehave: "reset" or "step" raise, "error" reports an error,
    "exit" raises on release, "gate" blocks the first step until ``gate`` is set.
    """

    def __init__(self, prompt, turns, fail=None, server=None, variables=None):
        self.prompt, self.turns, self.fail = tuple(prompt), turns, fail
        self.server, self.variables = server, variables
        self.actions = []
        self.released = False
        self.stepping, self.gate = threading.Event(), threading.Event()

    def reset(self):
        if self.fail == "reset":
            raise RuntimeError("no sandbox left")
        return Observation(self.prompt)

    def step(self, action):
        self.actions.append(action)
        if self.fail == "step":
            raise RuntimeError("tool crashed")
        if self.fail == "error":
            return Observation((), "error", "the tool said no")
        if self.fail == "gate":
            self.stepping.set()
            self.gate.wait(30)
        if self.fail == "push" and len(self.actions) == 1:  # new weights land between this session's turns
            self.server.load(self.variables, version=7)
        if len(self.actions) == self.turns:
            return Observation((), "completed", f"{self.turns} turns")
        return Observation(action.context + action.tokens + (TOOL_ID,))

    def metrics(self):
        if self.fail == "metrics":
            raise RuntimeError("no counters")
        return {"tool_calls": len(self.actions)}

    def close(self):
        self.released = True
        if self.fail == "exit":
            raise RuntimeError("cleanup failed")


class Harness:
    """The environment factory and verifier of a test; keeps every environment it opened."""

    def __init__(self, server=None, variables=None):
        self.opened: list[tuple[EpisodeId, CountingTool]] = []
        self.seen = []
        self.server, self.variables = server, variables

    def environment(self, task, identity):
        env = CountingTool(task.data["prompt_ids"], task.data.get("turns", 1), task.data.get("fail"),
                           self.server, self.variables)
        self.opened.append((identity, env))
        return env

    def verifier(self, task, episode):
        self.seen.append(episode)
        if task.data.get("verifier") == "crash":
            raise RuntimeError("grader down")
        if task.data.get("verifier") == "nan":
            return math.inf
        return float(len(episode.transitions)) if episode.status is EpisodeStatus.COMPLETED else -1.0

    def env(self, task_id, sample=0):
        return next(env for identity, env in self.opened if identity.task == task_id and identity.sample == sample)


def source(server, harness, **options):
    options = {"max_prompt_tokens": 40, "max_new_tokens": 4, "max_turns": 6, "workers": 4, "eos_ids": EOS, **options}
    return EnvironmentSource(server, harness.environment, harness.verifier, **options)


def test_environment_source_multi_turn_sessions_pack_as_one_chain(eos_server, sharp_decoder):
    harness = Harness(eos_server, sharp_decoder[1])
    with source(eos_server, harness) as environments:
        task = Task("7", {"prompt_ids": [20, 21, 22], "turns": 3})
        sessions = [f.result(timeout=60) for f in environments.submit(task, group=4, samples=6)]
        pushed = environments.submit(Task("8", {"prompt_ids": [20, 21], "turns": 2, "fail": "push"}), 0, 1)[0].result(60)
    completed = [s for s in sessions if s.status is Status.COMPLETED]
    assert len(completed) >= 2
    for s in sessions:
        env = harness.env(7, s.sample)
        identity = next(i for i, e in harness.opened if e is env)
        assert identity == EpisodeId(task=7, step=4, sample=s.sample, seed=identity.seed) and env.released
        for before, after in zip(s.calls, s.calls[1:]):  # the next context extends the last one by the tool's id
            assert after.prompt_ids == [*before.prompt_ids, *before.sampled_ids, TOOL_ID]
        assert [a.policy_step for a in env.actions] == [c.version for c in s.calls][: len(env.actions)]
        # turns, truncation and the environment's own numbers, read after its last step
        assert s.episode_metrics == {"turns": len(s.calls), "truncated": float(s.status is Status.TRUNCATED),
                                     "tool_calls": len(env.actions)}
        if s.status is Status.COMPLETED:
            assert len(s.calls) == 3 and s.reward == 3.0 and all(c.finish_reason == "stop" for c in s.calls)
        else:  # its last draw spent the budget: recorded, not sent to the tool, verified as truncated
            assert s.status is Status.TRUNCATED and s.calls[-1].finish_reason == "length"
            assert len(env.actions) == len(s.calls) - 1 and s.reward == -1.0
    assert len({tuple(s.calls[0].sampled_ids) for s in sessions}) > 1  # each sample draws with its own seed
    assert [c.version for c in pushed.calls] == [2, 7]  # each call keeps the version it was submitted under
    eos_server.load(sharp_decoder[1], version=2)
    trained = [s for s in sessions + [pushed] if s.status is Status.COMPLETED]
    assert len(chain_lengths(trained, 64)) == len(trained)  # every session's calls merge into one chain
    batch = pack(sessions + [pushed], width=64)
    logged = session_metrics(sessions, batch)  # every session's numbers, trained or not
    assert logged["episode/turns"] == pytest.approx(np.mean([len(s.calls) for s in sessions]))
    assert logged["episode/turns_max"] == max(len(s.calls) for s in sessions)
    assert logged["episode/truncated"] == pytest.approx(np.mean([s.status is Status.TRUNCATED for s in sessions]))
    assert logged["episode/tool_calls"] == pytest.approx(np.mean([s.episode_metrics["tool_calls"] for s in sessions]))
    for number, s in enumerate(sessions + [pushed]):
        columns = batch["session_index"] == number
        if s.status is Status.COMPLETED:
            assert columns.sum() == sum(len(c.sampled_ids) for c in s.calls)  # only sampled ids carry loss mass
            assert sorted(set(batch["versions"][columns])) == sorted({c.version for c in s.calls})
        else:
            assert not columns.any()  # truncation="mask" drops it


def test_environment_source_limits_truncate(eos_server):
    harness = Harness()
    with source(eos_server, harness, max_new_tokens=1, max_turns=2) as environments:
        budget = [f.result(60) for f in environments.submit(Task("1", {"prompt_ids": [20, 21], "turns": 1}), 0, 8)]
        # 32 samples: a sample needs EOS on both its draws to reach the turn limit, so 8 left none often enough
        turns = [f.result(60) for f in environments.submit(Task("2", {"prompt_ids": [20, 21], "turns": 5}), 0, 32)]
    with source(eos_server, harness, max_prompt_tokens=8, max_new_tokens=3) as environments:
        context = [f.result(60) for f in environments.submit(Task("3", {"prompt_ids": [20, 21, 22], "turns": 9}), 0, 4)]
        long_prompt = environments.submit(Task("4", {"prompt_ids": list(range(16, 25)), "turns": 1}), 0, 1)[0].result(60)

    for s in budget:  # one id per draw: those without EOS truncate before the tool sees them
        env = harness.env(1, s.sample)
        if s.calls[0].finish_reason == "length":
            assert s.status is Status.TRUNCATED and env.actions == [] and s.reward == -1.0
            assert harness.seen and any(e.status is EpisodeStatus.TRUNCATED for e in harness.seen)
        else:
            assert s.status is Status.COMPLETED and len(env.actions) == 1
    assert {s.status for s in budget} == {Status.COMPLETED, Status.TRUNCATED}
    over_turns = [s for s in turns if len(s.calls) == 2 and s.calls[-1].finish_reason == "stop"]
    assert over_turns
    for s in over_turns:  # a third model call would be needed: truncated, never verified
        assert s.status is Status.TRUNCATED and "max_turns=2" in s.detail and s.reward is None
    over_context = [s for s in context if "max_prompt_tokens=8" in s.detail]
    assert over_context
    for s in over_context:  # the calls made keep their whole input; the next context was too long
        assert s.status is Status.TRUNCATED and s.reward is None and all(len(c.prompt_ids) <= 8 for c in s.calls)
        last = s.calls[-1]
        assert last.finish_reason == "stop" and len(last.prompt_ids) + len(last.sampled_ids) + 1 > 8
    assert long_prompt.status is Status.TRUNCATED and long_prompt.calls == [] and harness.env(4).released


def test_environment_source_failures_are_infrastructure_errors(eos_server):
    harness = Harness()
    tasks = {
        "10": {"fail": "step"}, "11": {"fail": "error"}, "12": {"fail": "reset"}, "13": {"fail": "exit"},
        "14": {"verifier": "crash"}, "15": {"verifier": "nan"}, "16": {"fail": "metrics"},
    }
    with source(eos_server, harness, max_new_tokens=8) as environments:
        results = {}
        for task_id, data in tasks.items():
            # search a few samples for one whose first draw ends on EOS, so the tool and verifier are reached
            futures = environments.submit(Task(task_id, {"prompt_ids": [20, 21], **data}), 0, 4)
            results[task_id] = next(s for s in (f.result(60) for f in futures)
                                    if task_id == "12" or s.calls[0].finish_reason == "stop")
    details = {
        "10": "tool crashed", "11": "the tool said no", "12": "no sandbox left", "13": "cleanup failed",
        "14": "grader down", "15": "finite", "16": "the environment's metrics() failed: RuntimeError('no counters')",
    }
    for task_id, session in results.items():
        assert session.status is Status.INFRA_ERROR and session.reward is None, (task_id, session)
        assert details[task_id] in session.detail
    assert all(env.released for _, env in harness.opened)  # released whatever failed


def test_environment_source_cancel_releases_the_environment(long_server, eos_server):
    harness = Harness()
    with source(long_server, harness, max_new_tokens=55) as environments:
        future = environments.submit(Task("20", {"prompt_ids": [1, 2, 3], "turns": 3}), 0, 1)[0]
        while environments._live.get(future) is None or environments._live[future].draw is None:
            time.sleep(0.001)
        wait_running(long_server, environments._live[future].draw)
        environments.cancel(future)  # mid-draw
        session = future.result(timeout=60)
    assert session.status is Status.CANCELLED and session.calls[0].finish_reason == "cancelled"
    assert 2 <= len(session.calls[0].sampled_ids) < 55 and harness.env(20).released

    with source(eos_server, harness, max_new_tokens=8) as environments:
        future = environments.submit(Task("21", {"prompt_ids": [20, 21], "turns": 3, "fail": "gate"}), 0, 1)[0]
        deadline = time.monotonic() + 30
        while not (harness.opened[-1][0].task == 21 and harness.opened[-1][1].stepping.is_set()):
            assert time.monotonic() < deadline, "the first draw did not end on EOS, so the tool was never called"
            time.sleep(0.001)
        env = harness.env(21)
        environments.cancel(future)  # inside the tool's step: it stops before the next draw
        env.gate.set()
        session = future.result(timeout=60)
    assert session.status is Status.CANCELLED and len(session.calls) == 1 and env.released


def test_a_subprocess_environment_serves_environment_source_sessions(eos_server):
    """SubprocessEnvironment.for_task is EnvironmentSource's environment(task, identity): each session a real
    worker process (tests/workers/square_worker.py) reset with the session's identity, stepped with its draw."""
    worker = str(Path(__file__).resolve().parent / "workers" / "square_worker.py")
    factory = SubprocessEnvironment([sys.executable, worker, "--turns", "1"], SandboxLimits(wall_seconds=60))
    verified = []

    def verifier(task, episode):
        verified.append(episode)
        return 1.0 if episode.status is EpisodeStatus.COMPLETED else 0.0

    with EnvironmentSource(eos_server, factory.for_task, verifier, max_prompt_tokens=40, max_new_tokens=4,
                           max_turns=2, workers=2, eos_ids=EOS) as environments:
        sessions = [f.result(timeout=120) for f in environments.submit(Task("5", {}), group=3, samples=4)]
    assert {s.status for s in sessions} <= {Status.COMPLETED, Status.TRUNCATED}
    assert all(s.calls[0].prompt_ids == [1, 15] for s in sessions)  # the worker's reset context for task 5
    completed = [s for s in sessions if s.status is Status.COMPLETED]
    assert completed and all(s.reward == 1.0 and len(s.calls) == 1 for s in completed)
    resets = sorted(episode.reset.detail for episode in verified)
    assert resets[0].startswith("task=5 step=3 sample=")  # the identity reached the worker's reset request
    for episode in verified:
        if episode.status is EpisodeStatus.COMPLETED:  # the worker saw the sampled ids and the EOS flag
            action = episode.transitions[-1].action
            assert episode.detail == f"answer {action.tokens[0]} eos=True"
