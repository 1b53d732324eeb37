"""Where the RLVR pipeline starts its actors, and stops them: every role of one run, in one place.

:class:`RLVRActors` reserves every role's CPUs (and GPUs) at once in one placement group
(:class:`~dew_ray.placement.RolePlacement`, one placement group per role, placed as the
config's ``*_strategy`` and ``*_resources`` say; the driver runs the warm start as a task in
the first trainer's bundle), then starts, each actor in its own bundle (rollout servers,
sandbox runners, environment workers and judge servers with ``max_restarts=restarts``):

- with ``start_roles(params, runner)``, ``servers`` rollout servers: RolloutServerActors behind a :class:`~dew_ray.actors.ServerPool`
  (``engine="native"``), or VLLMEngineActors launched on ``<run_dir>/engine/policy`` behind
  an EnginePool (``engine="vllm"``): the driver draws held-out samples through ``pool``;
  and ``sandbox_runners`` SandboxRunnerActors behind a :class:`~dew_ray.actors.RemoteFleet`
  (``fleet``); with an ``environment``, ``environment_workers`` EnvironmentWorker actors
  whose sessions call the rollout servers (each builds the environment itself:
  :class:`~dew_ray.pipelines.rlvr_job.PipelineEnvironment`);
- with a judge (reward="judge"), ``judge_servers`` RolloutServerActors serving the judge model
  greedily behind ``judge_pool``, never pushed to;
- with ``start_trainers(params)``, ``trainers`` TrainerActors (one ``jax.distributed`` job)
  whose jobs (:func:`~dew_ray.pipelines.rlvr_job.trainer_job`) reach the servers and runners.

``stop()`` closes the trainers and the pool, ends every actor and frees the placement group.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets

import jax.numpy as jnp
import ray

from dew.inference import SafetensorsReload, ServingTask
from dew.sampling import Sampling
from dew_ray.actors import (
    start_environment_workers,
    start_rollout_servers,
    start_sandbox_runners,
    start_trainer_group,
    start_vllm_engines,
)
from dew_ray.pipelines.rlvr_job import (
    ENGINE_MODEL,
    PipelineEnvironment,
    Setup,
    engine_args,
    engine_policy,
    engine_rollouts,
    sandbox_fleet,
    trainer_job,
)
from dew_ray.actors.rollout_server_actor import RolloutServerActor
from dew_ray.placement import RolePlacement
from dew.recipes.rlvr_recipe import SANDBOX_LIMITS
from dew.recipes.run_inputs import DTYPES


class RLVRActors:
    """Every actor of one run (see the module docstring); ``name`` names the placement group and the actors."""

    def __init__(self, setup: Setup, name: str):
        config = setup.config
        self.setup = setup
        self.servers: list = []
        self.runners: list = []
        self.trainers: list = []
        self.pool = self.fleet = None
        self.environment_workers: list = []
        self.grown: list = []  # (placement, server names) of servers added during the run
        self.removed: list[str] = []  # servers taken out during the run
        self.judge_pool = None
        self.placement = RolePlacement(config.roles(), name=name)
        # a lost server, engine, runner or worker comes back in its bundle (a lost trainer restarts the run's actors)
        self.restarts = {"max_restarts": config.restarts}

    def start_roles(self, params, runner, judge=None) -> None:
        """The rollout servers serving ``params`` (version -1), the sandbox runners (``runner``: the preflight's),
        the judge servers (``judge``: the judge Policy, for reward="judge") and the environment workers."""
        config = self.setup.config
        if judge is not None:  # greedy, and never pushed to: the same response always gets the same verdict
            sampling = Sampling(eos_id=self.setup.judge_eos_ids, temperature=0.0)
            task = ServingTask(judge.model, judge.params, sampling, batch_invariant=config.deterministic)
            self.judge_pool = start_rollout_servers(
                task, config.judge_servers, slots=config.slots,
                capacity=config.judge_max_length, placement=lambda i: self.placement.options("judge server", i),
                timeout=config.server_timeout, pushed=False, **self.restarts)
            self.setup.judges = [(server.name, server.actor) for server in self.judge_pool.servers]
        self.servers = self._start_servers(params)
        self.runners = start_sandbox_runners(config.sandbox_runners, runner, SANDBOX_LIMITS,
                                             workers=config.sandbox_workers,
                                             placement=lambda i: self.placement.options("sandbox runner", i),
                                             **self.restarts)
        self.fleet = sandbox_fleet(self.runners, config)
        if self.setup.environment is not None:  # each worker builds the environment in its own process
            # kept for the run (start_environment_workers): a restarted worker builds its environment from it again
            self.environment_workers = start_environment_workers(
                config.environment_workers, self.pool, build=PipelineEnvironment(self.setup, self.runners),
                server_timeout=config.server_timeout, workers=config.slots, **self.setup.episode_options(),
                placement=lambda i: self.placement.options("environment worker", i), actor_options=self.restarts)

    def _start_servers(self, params) -> list:
        setup, config = self.setup, self.setup.config
        placement = lambda i: self.placement.options("rollout server", i)  # noqa: E731
        if config.engine == "vllm":  # the engines launch on the warm-started policy, written where they read it
            directory = engine_policy(setup.run_dir)
            SafetensorsReload(setup.pretrained, directory, [], "vllm").write(params)
            setup.tokenizer.save_pretrained(directory)  # the engines load the run's tokenizer beside the weights
            # the engines listen on their nodes' addresses: every route but /health asks for the run's key
            setup.engine_key = secrets.token_urlsafe(32)
            actors, setup.engines = start_vllm_engines(
                directory, config.servers, name=ENGINE_MODEL, dtype=config.engine_dtype, max_model_len=setup.width,
                max_num_seqs=config.slots, args=engine_args(config), placement=placement, api_key=setup.engine_key,
                **self.restarts, **({"python": config.engine_python} if config.engine_python else {}))
            setup.engine_hosts = actors
            # The driver's own pushes (the final policy, for the held-out measure) go through the disk whatever
            # engine_push the trainers use: the driver holds no GPU to broadcast from.
            self.pool = engine_rollouts(setup, version=-1)
            return actors
        # served in engine_dtype over float32 activations, whatever the trainer computes in (Server's convention)
        task = ServingTask(setup.model.clone(dtype=jnp.float32), params, setup.sampling(),
                           dtype=DTYPES[config.engine_dtype], batch_invariant=config.deterministic)
        self.pool = start_rollout_servers(task, config.servers, slots=config.slots, capacity=setup.width, version=-1,
                                          placement=placement, timeout=config.server_timeout, **self.restarts)
        return [server.actor for server in self.pool.servers]

    def add_servers(self, count: int, name: str, wait: float = 300.0) -> tuple[list[str], list]:
        """``count`` more rollout servers (engine="native"), each in a bundle of a placement group of their own
        (``name``; RuntimeError when the cluster cannot place it within ``wait`` seconds), joining every pool: the
        driver's, each trainer's and each environment worker's. They start stale and take draws once a trainer's
        pool has loaded them with its newest weights. Returns their names and where each stands."""
        config = self.setup.config
        if config.engine != "native":
            raise ValueError("adding servers during a run needs engine='native' (vLLM engines are a fixed fleet)")
        role = dataclasses.replace(config.roles()["rollout server"], count=count)  # as the run's own servers ask
        placement = RolePlacement({"rollout server": role}, timeout=wait, name=name)
        first = len(self.pool.servers)
        names = [f"rollout server {first + i}" for i in range(count)]
        # kept before the trainers are told, which fails when one was lost meanwhile: stop() then frees the group
        # and ends its servers, and a recovery's fleet can take the group's name again (a chaos run's trainer kill
        # followed by a fleet request left it held, and the request, served again after the recovery, stopped the
        # driver on the name)
        self.grown.append((placement, names))
        actors = [RolloutServerActor.options(**placement.options("rollout server", i), **self.restarts)
                  .remote(self.pool.task, config.slots, self.setup.width, version=-1, stale=True)
                  for i in range(count)]
        self.servers += actors
        pairs = list(zip(names, actors))
        for server_name, actor in pairs:
            self.pool.add(actor, server_name)
        ray.get([trainer.add_servers.remote(pairs) for trainer in self.trainers])
        ray.get([worker.add_servers.remote(pairs) for worker in self.environment_workers])
        return names, placement.where()

    def remove_servers(self, names: list[str], timeout: float) -> int:
        """Take the named rollout servers out of every pool, then end them; their draws get ``timeout`` seconds to
        finish and then go to the others. Returns how many draws went to the others."""
        moved = sum(ray.get([trainer.remove_servers.remote(names, timeout) for trainer in self.trainers]))
        moved += sum(ray.get([worker.remove_servers.remote(names, timeout) for worker in self.environment_workers]))
        for name in names:
            moved += self.pool.remove(name, timeout)
            server = next(server for server in self.pool.servers if server.name == name)
            self.servers.remove(server.actor)
            ray.kill(server.actor)
        for placement, held in list(self.grown):  # a group whose servers are all gone is freed
            if set(held) <= set(self.removed) | set(names):
                placement.remove()
                self.grown.remove((placement, held))
        self.removed += names
        return moved

    def start_trainers(self, params) -> list[dict]:
        """The trainer group, each process's job built from the setup; returns what each trainer's start reported."""
        named = [] if self.setup.engines else [(server.name, server.actor) for server in self.pool.servers]
        build = functools.partial(trainer_job, self.setup, params, named, self.runners, self.environment_workers)
        self.trainers, started = start_trainer_group(build, processes=self.setup.config.trainers,
                                                     placement=lambda i: self.placement.options("trainer", i))
        return started

    def stop(self) -> None:
        """Close the trainers and the pool, end every actor and free the placement group."""
        # All at once: a trainer of a group leaves jax.distributed only when every process of the group does, so
        # closing one at a time held the first for the whole timeout. A dead trainer has nothing left to close.
        closing = [trainer.close.remote() for trainer in self.trainers]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=60)
        if self.pool is not None:
            self.pool.close()
        closing = [worker.close.remote() for worker in self.environment_workers]
        if closing:  # their tool processes and sandboxes end with their sessions
            ray.wait(closing, num_returns=len(closing), timeout=30)
        judges = [server.actor for server in self.judge_pool.servers] if self.judge_pool is not None else []
        if self.judge_pool is not None:
            self.judge_pool.close()
            self.judge_pool = None
        for actor in [*self.environment_workers, *self.servers, *self.runners, *self.trainers, *judges]:
            ray.kill(actor)
        self.trainers, self.servers, self.runners, self.environment_workers = [], [], [], []
        self.placement.remove()
        for placement, _ in self.grown:
            placement.remove()
        self.grown = []
