"""Restartable roles built from kept arguments, in a fresh process, for tests/test_kept_arguments.py.

Ray prints its "constructor arguments in the object store" line once per process, at the first restartable actor
with such an argument; this script is that process. It starts, each with ``max_restarts=1`` as the RLVR pipeline
does, a rollout server (``start_rollout_servers``), an environment worker over it (``start_environment_workers``)
and a sandbox runner, SIGKILLs the worker's process, and checks that it came back built from the same arguments
(its environment, verifier and the server's handle: it runs a session on the server). A restarted server built from
its kept task is tests/test_ray_actors.py's. After closing them it prints the keeper's keys (none are left), then ``control`` on stderr, and starts a
restartable actor from a plain ObjectRef: the line Ray prints for that one shows the check can see it.
"""

import os
import signal
import sys
import time
from pathlib import Path

import ray
from ray import cloudpickle

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import load  # noqa: E402  (bench/load.py: the sharp decoder)
import test_rollout_sources  # noqa: E402  (the counting tool's harness)

from dew.inference import ServingTask  # noqa: E402
from dew.records.session_records import Status, Task  # noqa: E402
from dew.sampling import Sampling  # noqa: E402
from dew.sandbox import ProcessRunner, SandboxLimits  # noqa: E402
from dew_ray.actors import RemoteEnvironmentSource, start_environment_workers, start_rollout_servers  # noqa: E402
from dew_ray.actors import start_sandbox_runners  # noqa: E402
from dew_ray.kept_arguments import keeper_name  # noqa: E402

EOS = tuple(range(16))


def restarted(actor, pid: int, within: float = 120.0) -> int:
    """The pid of ``actor``'s next incarnation, once it answers."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            now = ray.get(actor.__ray_call__.remote(lambda host: os.getpid()), timeout=10)
            if now != pid:
                return now
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the actor of pid {pid} did not come back within {within} s")


def main() -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    cloudpickle.register_pickle_by_value(test_rollout_sources)  # the actors cannot import the tests
    model, variables = load.sharp_decoder()
    task = ServingTask(model, variables, Sampling(eos_id=EOS, temperature=1.0, top_k=8))
    pool = start_rollout_servers(task, count=1, slots=4, capacity=64, version=0, num_cpus=0.5, timeout=5,
                                 max_restarts=1)
    harness = test_rollout_sources.Harness()
    workers = start_environment_workers(1, pool, harness.environment, harness.verifier, num_cpus=0.5,
                                        actor_options={"max_restarts": 1}, max_prompt_tokens=40, max_new_tokens=4,
                                        max_turns=4, workers=4, eos_ids=EOS)
    runners = start_sandbox_runners(1, ProcessRunner(), SandboxLimits(), workers=1, num_cpus=0.5, max_restarts=1)
    source = RemoteEnvironmentSource(workers)
    first = source.submit(Task("1", {"prompt_ids": [20, 21, 22], "turns": 2}), 0, 1)[0].result(120)
    assert first.status is Status.COMPLETED, (first.status, first.detail)

    server = pool.servers[0].actor
    pid = ray.get(workers[0].__ray_call__.remote(lambda host: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    restarted(workers[0], pid)
    again = source.submit(Task("2", {"prompt_ids": [20, 21], "turns": 2}), 0, 1)[0].result(120)
    assert again.status is Status.COMPLETED, (again.status, again.detail)
    print("restarted and served")

    ray.get([worker.close.remote() for worker in workers])
    pool.close()
    keeper = ray.get_actor(keeper_name())
    print("kept after closing:", ray.get(keeper.keys.remote()))
    for actor in [*workers, server, *runners]:
        ray.kill(actor)

    print("control", file=sys.stderr, flush=True)
    control = ray.remote(max_restarts=1, num_cpus=0)(Holder).remote(ray.put(1))
    assert ray.get(control.get.remote()) == 1
    time.sleep(0.5)  # Ray's line is written by its own logger thread
    print("done")


class Holder:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


if __name__ == "__main__":
    main()
