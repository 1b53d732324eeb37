"""Constructor arguments kept by name for restartable actors (dew_ray.kept_arguments)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

ray = pytest.importorskip("ray")

from dew_ray.kept_arguments import Kept, keep, keeper_name, unkept  # noqa: E402

WARNING = "has constructor arguments in the object store"


class Reader:
    """A restartable actor built from a kept value."""

    def __init__(self, table):
        self.table = unkept(table)

    def total(self) -> int:
        return sum(self.table["numbers"])

    def pid(self) -> int:
        return os.getpid()


@pytest.mark.ray
def test_a_restarted_actor_reads_its_kept_argument_again_until_it_is_released(cluster):
    """A value over Ray's inline size, kept: the Kept pickles small, the actor reads the value, and after its process
    is SIGKILLed its new incarnation reads it again; once released, a read names the released key."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor cannot import the tests
    table = {"numbers": list(range(50_000))}
    kept = keep(table)
    assert isinstance(kept, Kept) and len(ray.cloudpickle.dumps(kept)) < 300
    assert unkept(table) is table  # an argument that was not kept is passed through
    reader = ray.remote(max_restarts=1, num_cpus=0)(Reader).remote(kept)
    assert ray.get(reader.total.remote()) == sum(range(50_000))
    pid = ray.get(reader.pid.remote())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        try:
            assert ray.get(reader.pid.remote(), timeout=10) != pid
            break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "the reader did not come back"
            time.sleep(0.2)
    assert ray.get(reader.total.remote()) == sum(range(50_000))
    assert kept.key in ray.get(ray.get_actor(keeper_name()).keys.remote())
    kept.release()
    with pytest.raises(ray.exceptions.RayTaskError, match=f"kept as '{kept.key}' was released"):
        kept.value()
    ray.kill(reader)


@pytest.mark.ray
@pytest.mark.slow
def test_restartable_roles_come_back_from_kept_arguments_and_ray_prints_no_warning():
    """tests/workers/restartable_roles.py in a fresh process (Ray prints its line once per process): a rollout
    server, an environment worker and a sandbox runner started with max_restarts, as the RLVR pipeline starts
    them; the worker comes back after SIGKILL built from the same arguments; closing releases every kept one; and
    Ray's "constructor arguments in the object store" line is printed only for the control actor built from a
    plain ObjectRef, after the roles."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    ran = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "restartable_roles.py")], cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "restarted and served" in ran.stdout and "kept after closing: []" in ran.stdout, ran.stdout
    before, control, after = ran.stderr.partition("control\n")
    assert control, ran.stderr[-3000:]
    assert WARNING not in before, before[-3000:]
    assert WARNING in after, after[-3000:]  # Ray still prints it where it applies: the check above can fail


def test_a_fetch_waiting_for_a_key_wakes_when_it_is_kept_or_released():
    """The keeper's fetch waits for a key the driver's call has not brought yet; a release wakes it at once with the
    key named, not at its timeout."""
    import asyncio

    from dew_ray.kept_arguments import ArgumentKeeper

    async def run():
        keeper = ArgumentKeeper(wait=30)
        waiting = asyncio.ensure_future(keeper.fetch("a"))
        await asyncio.sleep(0.05)
        await keeper.keep("a", ["reference"])
        assert await waiting == ["reference"]
        waiting = asyncio.ensure_future(keeper.fetch("b"))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await keeper.release("b")
        with pytest.raises(KeyError, match="kept as 'b' was released"):
            await waiting
        assert time.monotonic() - started < 5

    asyncio.run(run())
