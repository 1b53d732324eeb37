"""dew_ray actors on a local Ray cluster: rollout servers, weight broadcast, sandbox runners, fault tolerance."""

import asyncio
import itertools
import os
import signal
import threading
import time

import jax
import numpy as np
import optax
import pytest
from conftest import import_from
from ray.exceptions import ActorPlacementGroupRemoved, ActorUnavailableError, ActorUnschedulableError, RayActorError

ray = pytest.importorskip("ray")

from dew import Dataset, Trainer  # noqa: E402
from dew.data.prompts import utf8_column  # noqa: E402
from dew.inference import NativeRolloutServer, Server, ServerDied, ServingTask  # noqa: E402
from dew.collection.sources import PromptSource  # noqa: E402
from dew.objectives.grpo import GRPOObjective  # noqa: E402
from dew.collection.scheduler import RolloutScheduler  # noqa: E402
from dew.collection.tasks import prompt_tasks  # noqa: E402
from dew.sampling import Sampling  # noqa: E402
from dew.sandbox import CodeReward, ProcessRunner, Program, SandboxFleet, SandboxLimits, Verdict  # noqa: E402
from dew_ray.actors import (  # noqa: E402
    RemoteFleet,
    RemoteRolloutServer,
    RolloutServerActor,
    ServerPool,
    start_rollout_servers,
    start_sandbox_runners,
)
from dew_ray.actor_loss import actor_lost  # noqa: E402
from dew_ray.pipelines.rlvr_config import load_config  # noqa: E402
from dew_ray.pipelines.rlvr_job import sandbox_fleet  # noqa: E402
from dew_ray.weight_broadcast import WeightBroadcast  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
EOS = tuple(range(16))


@pytest.fixture(scope="module")
def serving(sharp_decoder):
    model, variables = sharp_decoder
    return ServingTask(model, variables, Sampling(eos_id=EOS, temperature=1.0, top_k=8))


@pytest.fixture(scope="module")
def endless(sharp_decoder):
    """No EOS: every draw runs to its budget unless cancelled."""
    model, variables = sharp_decoder
    return ServingTask(model, variables, Sampling(temperature=1.0, top_k=8))


def test_a_remote_server_draws_what_the_local_one_draws(cluster, serving, endless, sharp_decoder):
    prompts = [([20, 21, 22], 11), ([23, 24], 12), ([25], 13)]
    with NativeRolloutServer(Server.from_task(serving, slots=4, capacity=64), version=3) as local:
        want = [local.submit(p, 8, seed=s).result(60) for p, s in prompts]
    actor = RolloutServerActor.options(num_cpus=0.5).remote(serving, 4, 64, version=3)
    remote = RemoteRolloutServer(actor, "server A")
    got = [remote.submit(p, 8, seed=s).result(120) for p, s in prompts]
    assert [d.ids for d in got] == [d.ids for d in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.behavior_log_probs, w.behavior_log_probs, atol=1e-6)
        np.testing.assert_allclose(g.old_log_probs, w.old_log_probs, atol=1e-6)
        assert g.version == 3 and g.eos == w.eos

    remote.load(sharp_decoder[1], version=4)  # one put, the actor serves version 4 from the next step
    assert remote.version == 4 and ray.get(actor.version.remote()) == 4
    assert remote.submit([20, 21], 4, seed=1).result(60).version == 4

    long = RolloutServerActor.options(num_cpus=0.5).remote(endless, 2, 64)
    slow = RemoteRolloutServer(long, "server B")
    draw = slow.submit([20, 21], 60, seed=0)
    time.sleep(0.5)
    slow.cancel(draw)
    stopped = draw.result(60)
    assert stopped.finish_reason == "cancelled" and len(stopped.ids) < 60
    with pytest.raises(ValueError, match="outside the vocabulary"):
        slow.submit([20, 999], 4).result(60)
    for handle in (actor, long):
        ray.kill(handle)


@ray.remote
class Refusing:
    def __init__(self):
        self.version = 0

    def load(self, variables, version):
        raise ValueError("the tree has no 'params' collection")


@ray.remote
class Accepting:
    def __init__(self):
        self.loaded = None

    def load(self, variables, version):
        self.loaded = (sorted(variables), version)
        return version

    def seen(self):
        return self.loaded


def test_weight_broadcast_moves_the_version_only_when_every_actor_loaded(cluster):
    good, bad = Accepting.remote(), Refusing.remote()
    tree = {"params": {"w": np.ones((4, 4), np.float32)}}
    broadcast = WeightBroadcast([good], ["good"], version=0)
    broadcast.load(tree, 1)
    assert broadcast.version == 1 and ray.get(good.seen.remote()) == (["params"], 1)
    both = WeightBroadcast([good, bad], ["good", "refusing server"], version=1)
    with pytest.raises(RuntimeError, match="publishing version 2 failed on refusing server.*no 'params'"):
        both.load(tree, 2)
    assert both.version == 1
    ray.kill(bad)
    survivors = WeightBroadcast([good, bad], ["good", "killed"], version=1, drop_dead=True)
    survivors.load(tree, 3)
    assert survivors.version == 3 and survivors.dropped == ["killed"] and survivors.names == ["good"]
    # every actor left is set aside (restarting, say): the load waits for one to rejoin, which loads its weights
    survivors.set_aside("good")
    loading = threading.Thread(target=survivors.load, args=(tree, 4))
    loading.start()
    time.sleep(0.5)
    assert loading.is_alive() and survivors.rejoin("good")
    loading.join(30)
    assert survivors.version == 4 and ray.get(good.seen.remote()) == (["params"], 4)
    survivors.wait = 0.5  # none comes back: the load fails, and the broadcast stays where it was
    survivors.set_aside("good")
    with pytest.raises(RuntimeError, match="publishing version 5 failed.*set aside: good, waited 0.5 s"):
        survivors.load(tree, 5)
    assert survivors.version == 4


def test_a_pool_keeps_drawing_after_a_server_is_killed(cluster, endless, sharp_decoder):
    pool = start_rollout_servers(endless, count=2, slots=2, capacity=64, num_cpus=0.5)
    # 64 draws of 40 ids each per server, two slots each: seconds of work, so the kill lands mid-draw
    draws = [pool.submit([20, 21], 40, seed=i) for i in range(128)]
    killed = pool.servers[0]
    deadline = time.monotonic() + 60
    while ray.get(killed.actor.in_flight.remote()) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    # what a caller that draws again the moment its draw fails would find: a dead server fails its draws at once,
    # so, left in the pool until a liveness check answers, it would take every such draw as the least busy
    live_at_failure = []
    for draw in draws:
        draw.add_done_callback(lambda done: live_at_failure.append(pool.live()) if done.exception() else None)
    ray.kill(killed.actor)
    outcomes = []
    for draw in draws:
        try:
            outcomes.append(len(draw.result(300).ids))
        except RuntimeError as error:
            assert "server 0 died during a draw" in str(error)
            outcomes.append("died")
    assert outcomes.count("died") >= 2 and all(o in ("died", 40) for o in outcomes)
    assert outcomes.count(40) >= 64  # server 1's draws all finish
    assert len(live_at_failure) == outcomes.count("died") and all(live == [1] for live in live_at_failure)
    assert all(len(pool.submit([20], 3, seed=i).result(60).ids) == 3 for i in range(3))  # the survivor serves
    pool.load(sharp_decoder[1], version=1)
    assert pool.version == 1 and pool.servers[1].version == 1
    ray.kill(pool.servers[1].actor)


@ray.remote
class Holding:
    """An async actor whose load of ``held`` waits until released, as a load sent just before a server stalled waits
    on its arguments: a later load runs meanwhile (Ray starts an async actor's tasks as their arguments resolve)."""

    def __init__(self, held: int):
        self.held, self.release, self.version, self.applied = held, asyncio.Event(), 0, []

    async def load(self, variables, version):
        if version == self.held:
            await self.release.wait()
        self.version = version
        self.applied.append(version)
        return version

    async def let_go(self):
        self.release.set()

    async def seen(self):
        return self.version, self.applied


def test_a_rejoining_actor_gets_the_newest_weights_only_after_the_load_it_did_not_answer(cluster):
    """A load the actor did not answer in time sets it aside; its rejoin waits for that load to end before it sends
    the newest, so the older never lands last and the served version never goes back."""
    tree = {"params": {"w": np.ones((2, 2), np.float32)}}
    slow, quick = Holding.remote(1), Holding.remote(0)
    ray.get([slow.seen.remote(), quick.seen.remote()])  # both started: only the held load goes unanswered
    broadcast = WeightBroadcast([slow, quick], ["slow", "quick"], version=0, timeout=1.0, drop_dead=True, wait=5)
    broadcast.load(tree, 1)  # slow does not answer: set aside
    assert broadcast.aside == {"slow"} and broadcast.version == 1
    broadcast.load(tree, 2)
    assert not broadcast.rejoin("slow")  # its version-1 load still runs: nothing newer is sent
    slow.let_go.remote()
    assert broadcast.rejoin("slow") and broadcast.aside == set()
    assert ray.get(slow.seen.remote()) == (2, [1, 2])


@ray.remote
class Unanswering:
    """A rollout server gone bad: every draw fails at once, and asking whether it lives never answers."""

    async def draw(self, key, prompt_ids, max_new_tokens, seed):
        raise RuntimeError("the engine lost its device")

    async def serving(self):
        await asyncio.sleep(3600)

    async def cancel(self, key):
        pass


def test_a_server_that_stops_answering_does_not_hold_up_the_others(cluster, serving):
    """The pool asks a failed draw's server whether it lives (a Ray call that can wait its whole 30 s timeout):
    never under the lock submit takes, nor on the thread that resolves the other servers' draws."""
    bad = RemoteRolloutServer(Unanswering.options(num_cpus=0).remote(), "server bad", version=0)
    good = RemoteRolloutServer(RolloutServerActor.options(num_cpus=0.5).remote(serving, 4, 64), "server good")
    pool = ServerPool([bad, good])
    with pytest.raises(RuntimeError, match="lost its device"):
        pool.submit([20, 21], 4, seed=0).result(60)  # least busy: the bad one; its liveness check now hangs
    started = time.monotonic()
    draws = [pool.submit([20, 21], 4, seed=i) for i in range(8)]
    submitted = time.monotonic() - started
    outcomes = []
    for draw in draws:
        try:
            outcomes.append(len(draw.result(20).ids))
        except RuntimeError as error:
            assert "lost its device" in str(error)
            outcomes.append("failed")
    finished = time.monotonic() - started
    assert submitted < 5 and finished < 20, (submitted, finished)  # not the 30 s a held lock would cost
    assert any(o != "failed" for o in outcomes)  # the good server's draws came back meanwhile
    pool.close()
    for server in (bad, good):
        ray.kill(server.actor)


def _wait_until(condition, within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def test_a_pipelines_sandbox_fleet_reruns_a_lost_runners_program_as_max_attempts_allows():
    """max_attempts governs a sandbox program whose runner died as it governs a draw whose server died: a chaos run
    with max_attempts=10 lost its driver to a held-out program whose runner three node losses took, with the
    fleet's fixed 2 reruns spent."""
    assert sandbox_fleet([object()], load_config(None, ["max_attempts=10"])).retries == 9
    assert sandbox_fleet([object()], load_config(None, [])).retries == 2  # the default max_attempts, 3: as before


def test_remote_fleet_runs_programs_and_reruns_those_of_a_dead_runner(cluster):
    """Programs of a runner killed for good (ray.kill) and of one whose process was lost (SIGKILL, restarted by Ray)
    run again on the others; the restarted runner takes programs again once its new incarnation answers."""
    limits = SandboxLimits(wall_seconds=20)
    actors = start_sandbox_runners(3, ProcessRunner(), limits, workers=2, num_cpus=0.25, max_restarts=1)
    fleet = RemoteFleet(actors, workers=2)
    pid = ray.get(actors[2].__ray_call__.remote(lambda host: os.getpid()))  # asked before its workers are busy
    echo = [Program(files={"main.py": f"print({i} * 2)"}, argv=["python3", "main.py"]) for i in range(6)]
    outcomes = fleet.map(echo)
    assert [o.stdout.strip() for o in outcomes] == [str(i * 2) for i in range(6)]
    assert all(o.verdict is Verdict.COMPLETED for o in outcomes)
    failing = fleet.run(Program(files={"main.py": "raise SystemExit(3)"}, argv=["python3", "main.py"]))
    assert failing.verdict is Verdict.FAILED and failing.exit_code == 3  # a program's failure is an Outcome

    slow = [fleet.submit(Program(files={"main.py": "import time; time.sleep(1.5); print('done')"},
                                 argv=["python3", "main.py"])) for _ in range(6)]
    time.sleep(0.5)
    ray.kill(actors[0])  # no restart: gone for good
    os.kill(pid, signal.SIGKILL)  # its process lost: Ray restarts it
    assert [f.result(60).stdout.strip() for f in slow] == ["done"] * 6  # both runners' two ran again
    assert fleet.reruns >= 4  # a rerun that landed on the restarting runner ran a third time
    assert _wait_until(lambda: fleet.live == 2), (fleet.replicas.dead(), fleet.replicas.aside())
    assert fleet.replicas.dead() == [0] and ray.get(actors[2].__ray_call__.remote(lambda host: os.getpid())) != pid

    cases = '[{"stdin": "3\\n", "stdout": "9"}, {"stdin": "4\\n", "stdout": "16"}]'
    answer = "```python\nn = int(input())\nprint(n * n)\n```"
    with SandboxFleet(ProcessRunner(), limits, workers=2) as local:
        assert CodeReward(fleet)("code", answer, cases, "") == CodeReward(local)("code", answer, cases, "") == 1.0
    assert {o.stdout.strip() for o in fleet.map(echo)} == {str(i * 2) for i in range(6)}  # on both live runners
    for actor in actors[1:]:
        ray.kill(actor)


def test_training_continues_when_a_rollout_server_is_killed_mid_batch(cluster, endless, sharp_decoder):
    """Kills one of two RolloutServerActors once draws run on it after the first update (those of the third batch,
    or of the fourth when the least busy server took all of the third's); checks that its draws came back as
    infrastructure errors, were drawn again on the survivor, and every update trained."""
    model, served = sharp_decoder
    width = 48
    objective = GRPOObjective(model, seq_len=width - 1, behavior_importance=2.0, pretrained=served)
    # one slot per server: each holds several 32-id draws of the batch in flight at once
    pool = start_rollout_servers(endless, count=2, slots=1, capacity=64, version=-1, num_cpus=0.5)
    records = []

    killed = threading.Event()

    def kill_when_busy():  # the next batch to go out puts draws on server 0: kill it while they run
        actor = pool.servers[0].actor
        while not killed.is_set():
            if ray.get(actor.in_flight.remote()) >= 1:
                ray.kill(actor)
                killed.set()
            time.sleep(0.005)

    def log(record):
        records.append(record)
        if len(records) == 1:  # batches 1 and 2 have been drawn; batch 3 goes out at the next call
            threading.Thread(target=kill_when_busy, daemon=True).start()

    def prompts():
        for step in itertools.count():
            yield {"prompt": np.array([[20 + step % 5, 21, 22], [23, 24, 25]], np.int32),
                   "prompt_length": np.array([3, 3], np.int32), "data_source": utf8_column(["toy"] * 2),
                   "ground_truth": utf8_column(["x"] * 2), "extra_info": np.zeros((2, 0), np.int32)}

    with PromptSource(pool, lambda ds, text, gt, extra: float(len(text) % 3), max_new_tokens=32, workers=2) as source:
        scheduler = RolloutScheduler(objective, source, pool, width=width, rows=8, tasks=prompt_tasks, groups=4,
                                     max_lag=1, ahead=1, truncation="score", max_attempts=4, log=log)
        trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=scheduler, progress=False)
        state = trainer.fit(scheduler.tasks(Dataset(train=lambda partition: prompts())), steps=4)
        scheduler.close()
    assert int(state.updates) == 4 and all(r.admitted_groups == 2 and r.abandoned_groups == 0 for r in records)
    assert killed.is_set() and sum(r.resubmissions.get("infra_error", 0) for r in records) >= 1  # drawn again
    assert pool.live() == [1] and pool.version == 3
    ray.kill(pool.servers[1].actor)


def test_a_stopped_rollout_server_is_set_aside_and_rejoins(cluster, serving, sharp_decoder):
    """SIGSTOPs one of two pooled RolloutServerActors (alive to Ray, answering nothing): its draws fail as ServerDied
    within the pool's timeout and draw again on the other, a weight load skips it, and after SIGCONT it is loaded
    with the pool's newest weights and takes draws again."""
    timeout = 1.5
    pool = start_rollout_servers(serving, count=2, slots=2, capacity=64, version=0, num_cpus=0.5, timeout=timeout)
    stopped = pool.servers[0]
    pid = ray.get(stopped.actor.__ray_call__.remote(lambda host: os.getpid()))
    assert all(d.ids for d in [pool.submit([20, 21], 8, seed=s).result(60) for s in range(4)])
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        futures = [pool.submit([20 + s % 5, 21], 8, seed=s) for s in range(6)]
        outcomes = []
        for seed, future in enumerate(futures):
            try:
                outcomes.append(future.result(30))
            except ServerDied as error:
                assert "set aside" in str(error)
                outcomes.append(pool.submit([20 + seed % 5, 21], 8, seed=seed).result(30))  # drawn again
        assert time.monotonic() - began < 6 * timeout and pool.aside() == [0] and pool.live() == [1]
        assert all(d.ids for d in outcomes)
        began = time.monotonic()
        pool.load(sharp_decoder[1], 1)  # the silent server is not waited on
        assert time.monotonic() - began < timeout and pool.version == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while pool.aside() and time.monotonic() < deadline:  # probed until it answers, then loaded with version 1
        time.sleep(0.1)
    assert pool.live() == [0, 1] and ray.get(stopped.actor.version.remote()) == 1
    pool.load(sharp_decoder[1], 2)
    assert [ray.get(s.actor.version.remote()) for s in pool.servers] == [2, 2]
    assert all(d.version == 2 for d in [pool.submit([20, 21], 4, seed=s).result(60) for s in range(4)])
    # Both stopped (a lost node's servers while Ray starts them again): once both are set aside, a draw made again
    # waits for one to rejoin (up to RESTART_WAIT), well past the timeout, rather than failing.
    pids = [ray.get(server.actor.__ray_call__.remote(lambda host: os.getpid())) for server in pool.servers]
    for each in pids:
        os.kill(each, signal.SIGSTOP)
    resume = threading.Timer(8 * timeout, lambda: [os.kill(each, signal.SIGCONT) for each in pids])
    began = time.monotonic()
    resume.start()
    drawn = None
    try:
        for _ in range(3):  # the scheduler's way: a draw failed as ServerDied is drawn again
            try:
                drawn = pool.submit([20, 21], 4, seed=9).result(60)
                break
            except ServerDied:
                continue
        assert drawn is not None and drawn.ids and drawn.version == 2 and time.monotonic() - began >= 8 * timeout
    finally:
        resume.join()
    pool.close()
    for server in pool.servers:
        ray.kill(server.actor)


def test_a_restarted_rollout_server_loads_the_current_weights_before_it_draws(cluster, serving, sharp_decoder):
    """SIGKILLs the process of one of two RolloutServerActors started with max_restarts (its node lost, as Ray sees
    it): its draws fail as ServerRestarted and go to the other; Ray runs its constructor again, and the new
    incarnation (serving the weights it was created with, version 0) refuses draws until the trainer's pool loads
    it with version 1. A pool that never published (the driver's) leaves it aside until then."""
    pool = start_rollout_servers(serving, count=2, slots=2, capacity=64, version=0, num_cpus=0.5, timeout=5,
                                 max_restarts=1)
    driver = ServerPool([RemoteRolloutServer(s.actor, s.name, version=0) for s in pool.servers], timeout=5)
    pool.load(sharp_decoder[1], 1)
    lost = pool.servers[0]
    pid = ray.get(lost.actor.__ray_call__.remote(lambda host: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    outcomes = []
    for seed in range(8):  # a caller draws again the draws that fail, as the scheduler does
        try:
            outcomes.append(pool.submit([20, 21], 6, seed=seed).result(60))
        except ServerDied as error:
            assert "restart" in str(error), error
            outcomes.append(pool.submit([20, 21], 6, seed=seed).result(60))
    assert all(d.version == 1 for d in outcomes)  # none drawn on the restarted server's version-0 weights
    assert _wait_until(lambda: pool.live() == [0, 1]), (pool.live(), pool.aside(), pool.dead())
    assert tuple(ray.get(lost.actor.serving.remote())) == (1, False)
    assert ray.get(lost.actor.__ray_call__.remote(lambda host: os.getpid())) != pid  # a new incarnation
    for seed in range(4):  # the driver's pool found it at a draw, or finds it now, and takes it back once loaded
        try:
            assert driver.submit([20, 21], 4, seed=seed).result(60).version == 1
        except ServerDied:
            pass
    assert _wait_until(lambda: driver.live() == [0, 1], within=30), (driver.live(), driver.aside())
    pool.load(sharp_decoder[1], 2)
    assert all(d.version == 2 for d in [driver.submit([20, 21], 4, seed=s).result(60) for s in range(4)])
    for each in (pool, driver):
        each.close()
    for server in pool.servers:
        ray.kill(server.actor)


def test_every_server_lost_while_only_the_driver_draws_comes_back_from_its_catch_up_source(cluster, serving,
                                                                                          sharp_decoder):
    """The whole role lost during a held-out measurement: the trainers' pool published version 1 and waits on the
    driver, so nothing would load the restarted servers. The driver's pool, which never published, asks its
    ``catch_up`` source (the driver's trainers) for the newest weights and brings each server back with them."""
    pool = start_rollout_servers(serving, count=2, slots=2, capacity=64, version=0, num_cpus=0.5, timeout=5,
                                 max_restarts=1)
    pool.load(sharp_decoder[1], 1)
    driver = ServerPool([RemoteRolloutServer(s.actor, s.name, version=1) for s in pool.servers], timeout=5)
    asked = []
    driver.catch_up = lambda: asked.append(1) or (sharp_decoder[1], 1)
    for server in pool.servers:
        os.kill(ray.get(server.actor.__ray_call__.remote(lambda host: os.getpid())), signal.SIGKILL)
    drawn = []
    for seed in range(4):
        for _ in range(10):  # a caller draws again the draws that fail, as the measurement does
            try:
                drawn.append(driver.submit([20, 21], 4, seed=seed).result(120))
                break
            except ServerDied:
                continue
    assert len(drawn) == 4 and all(d.version == 1 for d in drawn), drawn
    assert asked  # the restarted servers were loaded from the source, not left aside for a push that never comes
    assert _wait_until(lambda: driver.live() == [0, 1], within=60), (driver.live(), driver.aside())
    assert not driver.publisher.published  # the source's weights were loaded once, not kept as the pool's newest
    for each in (pool, driver):
        each.close()
    for server in pool.servers:
        ray.kill(server.actor)


def test_a_server_added_mid_run_loads_the_newest_weights_first_and_a_removed_one_drains(cluster, serving,
                                                                                           endless, sharp_decoder):
    """A server joins a pool that has published version 1: it starts stale (serving its creation weights, version
    0), loads version 1 before its first draw, then takes its share. A removed server takes no new draw; its draws
    in flight fail as ServerDied once the drain timeout passes, and the others take them."""
    pool = start_rollout_servers(endless, count=1, slots=2, capacity=64, version=0, num_cpus=0.5, timeout=5)
    pool.load(sharp_decoder[1], 1)
    joining = RolloutServerActor.options(num_cpus=0.5).remote(pool.task, 2, 64, version=0, stale=True)
    pool.add(joining, "rollout server 1")
    assert _wait_until(lambda: pool.live() == [0, 1], within=60), (pool.live(), pool.aside())
    assert tuple(ray.get(joining.serving.remote())) == (1, False)
    draws = [pool.submit([20, 21], 4, seed=s) for s in range(8)]
    assert all(d.result(60).version == 1 for d in draws)
    assert ray.get(joining.in_flight.remote()) == 0 and len(pool.servers) == 2

    # far more draws than the 2 x 2 slots: a draw of 60 ids takes a fraction of a second here, so the joining
    # server's queue, not one draw, is what the removal finds in flight
    long = [pool.submit([20, 21], 60, seed=s) for s in range(64)]
    assert _wait_until(lambda: ray.get(joining.in_flight.remote()) > 0, within=30)
    moved = pool.remove("rollout server 1", timeout=0)  # no time to drain: what runs there goes to the other
    assert moved >= 1 and pool.live() == [0]
    outcomes = []
    for draw in long:
        try:
            outcomes.append(len(draw.result(120).ids))
        except ServerDied as error:
            assert "was removed from the pool" in str(error)
            outcomes.append("moved")
    assert outcomes.count("moved") == moved
    pool.load(sharp_decoder[1], 2)  # the removed server is published to no more
    assert ray.get(joining.version.remote()) == 1 and ray.get(pool.servers[0].actor.version.remote()) == 2
    pool.close()
    for actor in (pool.servers[0].actor, joining):
        ray.kill(actor)


def test_environment_workers_run_sessions_and_the_scheduler_trains_through_them(cluster, serving, sharp_decoder):
    """Sessions of the multi-turn counting tool on two EnvironmentWorkers over one RolloutServerActor; then a
    worker is killed with sessions running: they come back INFRA_ERROR and the survivor takes later ones."""
    import sys

    from ray import cloudpickle

    import test_rollout_sources
    from dew.records.session_records import Status, Task
    from dew_ray.actors import RemoteEnvironmentSource, start_environment_workers

    cloudpickle.register_pickle_by_value(test_rollout_sources)  # the actors cannot import the tests
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    harness = test_rollout_sources.Harness()
    model, served = sharp_decoder
    pool = start_rollout_servers(serving, count=1, slots=4, capacity=64, version=0, num_cpus=0.5)
    workers = start_environment_workers(2, pool, harness.environment, harness.verifier, num_cpus=0.25,
                                        max_prompt_tokens=40, max_new_tokens=4, max_turns=4, workers=4, eos_ids=EOS)
    source = RemoteEnvironmentSource(workers)
    sessions = [f.result(120) for f in source.submit(Task("5", {"prompt_ids": [20, 21, 22], "turns": 3}), 2, 6)]
    assert sorted(s.sample for s in sessions) == list(range(6))  # numbered within the group across workers
    completed = [s for s in sessions if s.status is Status.COMPLETED]
    assert completed, [(s.status, s.detail) for s in sessions]
    assert all(len(s.calls) == 3 and s.reward == 3.0 for s in completed)
    assert len({tuple(s.calls[0].sampled_ids) for s in sessions}) > 1  # no two samples share seeds

    width = 32
    objective = GRPOObjective(model, seq_len=width - 1, behavior_importance=2.0, pretrained=served)
    records = []
    scheduler = RolloutScheduler(objective, source, pool, width=width, rows=8,
                                 tasks=lambda batch: [Task(str(i), {"prompt_ids": [20 + i % 7, 21], "turns": 2})
                                                      for i in batch["task_id"]],
                                 groups=4, max_lag=1, ahead=1, truncation="score", log=records.append)
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=scheduler, progress=False)
    data = Dataset(train=lambda partition: ({"task_id": np.array([2 * i, 2 * i + 1])} for i in itertools.count()))
    state = trainer.fit(scheduler.tasks(data), steps=2)
    scheduler.close()
    assert int(state.updates) == 2 and all(r.admitted_groups == 2 for r in records)
    assert any(r.metrics["sessions/calls_per_chain"] > 1 for r in records)

    gated = source.submit(Task("6", {"prompt_ids": [20, 21], "turns": 1, "fail": "gate"}), 0, 2)  # block in step
    # the least busy worker takes each session, and the scheduler's cancelled sessions may still hold one worker:
    # kill the worker the first gated session runs on, wherever that is
    lost = source._where[gated[0]][0]
    time.sleep(1.0)
    ray.kill(workers[lost])
    first = gated[0].result(120)
    assert first.status is Status.INFRA_ERROR and f"environment worker {lost} failed" in first.detail
    gated[1].result(120)
    assert source.live == 1
    later = [f.result(120) for f in source.submit(Task("7", {"prompt_ids": [20, 21], "turns": 1}), 0, 2)]
    assert all(s.status is not Status.INFRA_ERROR for s in later)
    for actor in [workers[1 - lost], pool.servers[0].actor]:
        ray.kill(actor)


def test_the_rollout_path_settles_every_draw_once_under_load(cluster):
    # 48 draws at once on 2 actors of 4 slots: six times what the slots hold; each must equal an unloaded draw
    load = import_from("bench", "load")
    result = load.rollout_load(load.sharp_task(), draws=48, servers=2, slots=4)
    assert (result["lost"], result["lost_examples"], result["wrong"]) == (0, [], 0)
    assert (result["settled_twice"], result["unsettled"]) == (0, 0)


def test_keyed_calls_cancel_a_call_before_it_arrives_and_forget_old_cancels():
    """Ray does not order an actor's calls: a cancel may come first, and the call then returns cancelled at once."""
    from concurrent.futures import Future

    from dew_ray.actors.keyed_calls import KeyedCalls

    stopped = []
    calls = KeyedCalls(stopped.append, remembered=2)
    started = []

    def start():
        started.append(Future())
        return started[-1]

    async def scenario():
        calls.cancel("early")  # before its call
        assert await calls.run("early", start, lambda: "cancelled") == "cancelled" and not started
        running = asyncio.ensure_future(calls.run("late", start, lambda: "cancelled"))
        await asyncio.sleep(0)
        assert len(calls) == 1
        calls.cancel("late")  # a started call: its future is stopped, and its answer still comes back
        assert stopped == [started[0]]
        started[0].set_result("answer")
        assert await running == "answer" and len(calls) == 0
        for key in ("a", "b", "c"):  # at most two remembered: the oldest cancel is forgotten
            calls.cancel(key)
        assert await calls.run("c", start, lambda: "cancelled") == "cancelled"
        forgotten = asyncio.ensure_future(calls.run("a", start, lambda: "cancelled"))
        await asyncio.sleep(0)
        assert len(started) == 2  # "a" started: its cancel was forgotten
        started[1].set_result("ran")
        assert await forgotten == "ran"

    asyncio.run(scenario())


def test_an_actor_ray_cannot_place_again_counts_as_dead():
    """A fleet removal that takes a server's placement group while Ray restarts the server after a crash leaves an
    actor Ray cannot schedule ("Required placement group ... is removed"): the pools and the broadcast drop it as they
    drop a dead one, rather than failing the run."""
    assert actor_lost(ActorUnschedulableError("Required placement group 696f is removed.")) == "dead"
    assert actor_lost(ActorPlacementGroupRemoved()) == "dead" and actor_lost(RayActorError()) == "dead"
    assert actor_lost(ActorUnavailableError("restarting", None)) == "restarting"
    assert actor_lost(RuntimeError("a task's own error")) is None
