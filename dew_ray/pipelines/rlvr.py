"""Asynchronous RLVR on Ray: trainer, rollout-server and sandbox actors, driven step by step.

    python -m dew_ray.pipelines.rlvr [--config run.toml] [--set steps=40 --set servers=2 ...] [--address ADDR]

What runs where:

- a Ray task warm-starts the built-in decoder with SFT on the tasks' demonstrations, or a
  user's model on the ``warm_start`` conversations (:func:`dew.recipes.rlvr_recipe.warm_start`);
- ``servers`` RolloutServerActors serve it (NativeRolloutServer, continuous batching), or
  with ``engine="vllm"`` ``servers`` VLLMEngineActors each own a vLLM process launched on
  ``<run_dir>/engine/policy``, drawn from with OpenAIRolloutServer and published to by
  SafetensorsReload (every push checked by the landing probe);
- ``sandbox_runners`` SandboxRunnerActors run the code tasks' programs (bubblewrap by
  default);
- with an ``environment`` (the built-in ``"calculator"`` or a user's ``"module:factory"``),
  ``environment_workers`` EnvironmentWorker actors run each prompt as a multi-turn episode,
  each turn a draw on the rollout servers, and the trainers' schedulers take those sessions
  (a RemoteEnvironmentSource) in place of single draws; the held-out measure runs the same
  episodes from the driver (:func:`dew.recipes.rlvr_recipe.measure_episodes`);
- with ``reward="judge"``, ``judge_servers`` RolloutServerActors serve the judge model
  greedily (never pushed to) and every response is scored by its reply
  (:class:`~dew.recipes.judge_reward.JudgeReward`), on the scoring threads as draws finish;
- ``trainers`` TrainerActors (one JAX process each; several form one jax.distributed
  job) each own a Trainer whose rollout is a RolloutScheduler over a PromptSource on
  the servers (:class:`~dew_ray.actors.ServerPool`), scored by the built-in rewards
  with code on the sandbox pool (:class:`~dew_ray.actors.RemoteFleet`); the scheduler
  publishes weights to the servers through the object store
  (:class:`~dew_ray.weight_broadcast.WeightBroadcast`);
- one placement group reserves every actor's CPUs (the ``*_cpus`` fields) before any
  starts; every actor is started (and stopped) in :mod:`dew_ray.pipelines.rlvr_actors`;
- the driver (this process) only builds the actors, steps the trainers, writes the run
  directory and sets the dashboard series (:mod:`dew_ray.dashboard_metrics`).

What it trains is worked out by :func:`dew.recipes.rlvr_plan.plan_run` before anything
starts: the built-in decoder warm-started on the built-in verifiable tasks
(:mod:`dew.data.verifiable`), or a Hugging Face model directory (``model``) with its
tokenizer; verl-style prompt rows from ``prompts``/``val_prompts`` (Parquet, JSON lines or
a ``save_to_disk`` directory with ``data_source``, ``prompt``, ``reward_model.ground_truth``,
``extra_info``, such as verl's ``gsm8k.py`` writes), chat messages rendered by the
tokenizer's chat template; and the reward: the verifiable routes by ``data_source`` (code
rows in the sandbox) or the user's ``"module:function"``.

The run directory is resolved once, before any actor starts: a relative one against the
driver's working directory (on a local cluster, or one it attached to), and a submitted job
(``ray job submit``, whose driver runs in a packaged copy of the working directory that
dies with the session) must give an absolute path every node reaches. Actors only ever see
the absolute path; ``runs/`` is left out of a packaged working directory (``.rayignore``), and
a local cluster the driver starts packages nothing (its workers run the driver's interpreter:
:func:`~dew_ray.pipelines.run_dirs.start_ray`). Before the warm start the driver checks
what can fail early: the run directory is writable, the sandbox starts a program (and which
bubblewrap runs it), the cluster has the CPUs the roles reserve, and the configuration.

The run directory holds ``config.json``, ``warm_start.msgpack`` (the warm-started
weights), ``grpo/`` (the trainers' checkpoints, every ``checkpoint_every`` updates),
``metrics.jsonl`` (written by :mod:`~dew_ray.pipelines.run_record`, as are the held-out curve and
verl rows; one line per update: trainer and scheduler metrics, the tasks
trained, wait and wall seconds, a held-out measurement's time not in the wall), ``held_out.jsonl`` (the held-out reward before training,
after each of ``eval_points`` evenly spaced updates, on the weights the servers serve
then, which the default schedule publishes one update behind, and after the last), with
``verl_rows=true`` ``verl_rows/update-<step>.jsonl``
(that update's admitted rollouts as verl AgentLoopOutput rows, which
``dew.objectives.rl.verl.from_verl`` reads back), ``policy/`` (the final policy as Hugging Face
safetensors with its tokenizer), ``rlvr.png`` (reward and throughput) and
``summary.json``. Running again on the same directory resumes: the warm start is read
back, the trainers restore their newest checkpoint (data position included; the
batches that were in flight are drawn again) and metrics after that checkpoint are
dropped before training continues, so every task batch is trained exactly once.

The driver API: ``pipeline = RLVRPipeline(config)``, ``pipeline.start()``,
``pipeline.step(n)`` (returns the new metrics rows; ``pipeline.rows`` has them all),
``pipeline.finish()`` (final measurement, export, plot, summary) and ``pipeline.stop()``
(or use it as a context manager). :func:`run` does all of it with a progress bar.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import jax
import ray
from flax import serialization
from ray.exceptions import RayActorError, RayError
from tqdm import tqdm

from dew.experiment_trackers import MetricWriters
from dew.inference.engines import engine_dir, vllm_python
from dew.recipes.rlvr_plan import PlanError, RunPlan, plan_run
from dew.collection.sources import EnvironmentSource
from dew.recipes.rlvr_recipe import measure_episodes, measure_reward
from dew_ray.actors import ServerPool, step_group
from dew_ray.dashboard_metrics import PipelineMetrics
from dew_ray.pipelines.rlvr_actors import RLVRActors
from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig, load_config
from dew_ray.pipelines.rlvr_fleet import RLVRFleet
from dew_ray.pipelines.rlvr_job import PipelineEnvironment, Setup, pipeline_reward, start_params, warm_start_task
from dew_ray.pipelines.rlvr_report import plot, print_summary, zero_reward_note
from dew_ray.pipelines.run_record import RunRecord, update_row
from dew_ray.placement import shortfall
from dew_ray.pipelines.run_dirs import (
    PreflightError,
    check_sandbox,
    describe_runner,
    pipeline_main,
    resolve_run_dir,
    shared_on_nodes,
    start_ray,
    writable,
)

__all__ = ["PreflightError", "RLVRPipeline", "RLVRPipelineConfig", "load_config", "main", "resolve_run_dir", "run"]


class RLVRPipeline:
    """The driver of one run (see the module docstring); ``address`` attaches to a running cluster."""

    def __init__(self, config: RLVRPipelineConfig, address: str | None = None):
        if not isinstance(config, RLVRPipelineConfig):
            raise TypeError(f"RLVRPipeline needs an RLVRPipelineConfig, got {type(config).__name__}")
        self.config, self.address = config, address
        self.run_dir = resolve_run_dir(config.run_dir)  # before anything starts, and once
        self.record = RunRecord(self.run_dir)  # metrics.jsonl, held_out.jsonl, verl rows, trackers
        self.summary: dict | None = None
        self._started_ray = False
        self.started_at: float | None = None
        self.recoveries = 0  # times a lost trainer made the driver start the actors again from a checkpoint
        self.actors: RLVRActors | None = None
        self.metrics = None
        self.step_count = 0
        self.runner = None  # the sandbox runner the preflight started a program in; the runner actors get it
        self.sandbox: str | None = None
        self.plan: RunPlan | None = None  # what the run trains, worked out by the preflight
        self.episodes: EnvironmentSource | None = None  # with an environment, the held-out episodes' source
        self.placement: list = []  # where each actor's bundle stood when the actors started (RolePlacement.where)
        self.fleet: RLVRFleet | None = None  # the rollout fleet's bounds, growth and changes (start() makes it)
        # Whether the trainers wait on the driver (a held-out measurement): only then may the driver's pool ask them
        # for the newest weights, so that its calls never come between a collective's calls to the group
        self._trainers_idle, self._idle_lock = False, threading.Lock()

    @property
    def pool(self):
        """The driver's view of the rollout servers (held-out draws and the final policy go through it)."""
        return None if self.actors is None else self.actors.pool

    @property
    def rows(self) -> list[dict]:
        """Every update's metrics row so far (``metrics.jsonl``)."""
        return self.record.rows

    @property
    def held_out_curve(self) -> list[dict]:
        """{"step", "reward"} per held-out measurement so far, step 0 the warm start (``held_out.jsonl``)."""
        return self.record.curve

    @property
    def trainers(self) -> list:
        return [] if self.actors is None else self.actors.trainers

    # -- lifecycle --

    def preflight(self) -> str:
        """The checks that need no cluster: the run directory is writable and the sandbox runs a program.

        Returns which sandbox runs the code tasks (``start`` runs this first when nobody did).
        """
        writable(self.run_dir)
        given = self.config.engine_python
        if self.config.engine == "vllm" and given is not None and not os.access(Path(given).expanduser(), os.X_OK):
            raise PreflightError(f"config field 'engine_python' ({given!r}) is not an executable python on this node")
        if self.config.engine == "vllm" and given is None and vllm_python() is None:
            raise PreflightError(f"engine=vllm needs the vLLM engine environment ({engine_dir('vllm')}), which is not "
                                 "built: run `uv run python tools/engine_env.py vllm` (a few minutes, once; "
                                 "`vllm-cuda` on a GPU node), or set engine_python to a python with vLLM")
        self.preflight_plan()
        self.runner = check_sandbox(self.config.runner, self.config.container_image)
        self.sandbox = describe_runner(self.runner)
        return self.sandbox

    def preflight_plan(self) -> RunPlan:
        """Read the model and prompts and check what the run needs of them (:func:`plan_run`), once."""
        if self.plan is None:
            try:
                self.plan = plan_run(self.config)
            except PlanError as error:
                raise PreflightError(str(error)) from None
        return self.plan

    def start(self) -> dict:
        """Start Ray (unless attached), warm-start or read back the warm start, start every actor (printing the node
        each one stands on)."""
        config = self.config
        if self.started_at is None:  # a recovery's start keeps the run's
            self.started_at = time.perf_counter()
        # What can fail before any work starts fails now, within seconds, naming the fix.
        if self.sandbox is None:
            self.preflight()
        demand = config.cpu_demand()
        if not ray.is_initialized():
            start_ray(self.address, sum(demand.values()))
            self._started_ray = True
        short = shortfall(config.roles())
        if short is not None:
            raise PreflightError(short)
        (self.run_dir / "config.json").write_text(json.dumps({**config.model_dump(), "run_dir": str(self.run_dir)},
                                                             indent=2))
        plan = self.preflight_plan()
        self.setup = setup = Setup(config, str(self.run_dir), plan.width, plan.prompt_len, plan.train.rows,
                                   plan.policy.model, plan.policy.tokenizer, plan.policy.pretrained, plan.eos_ids,
                                   plan.reward, plan.template_options, environment=plan.environment,
                                   context_tokens=plan.context_tokens, demonstrations=plan.demonstrations,
                                   judge_tokenizer=plan.judge.tokenizer if plan.judge else None,
                                   judge_eos_ids=plan.judge_eos_ids, judge_parse=plan.judge_parse)
        # Every actor's CPUs are reserved at once, in one place, before anything starts.
        name = f"dew-rlvr-{self.run_dir.resolve().name}"  # names the placement groups and the actors
        self.actors = actors = RLVRActors(setup, name=name)
        self.fleet = RLVRFleet(config, self.run_dir, name=name)
        self.placement = actors.placement.where()
        for where in self.placement:  # every start, a recovery's too: where the actors stand now
            print(f"placement: {where.describe()}", flush=True)
        shared_on_nodes(self.run_dir, {where.node: where.address for where in self.placement})
        self.params = self._warm_params(setup, plan)
        actors.start_roles(self.params, self.runner, plan.judge)
        if isinstance(self.pool, ServerPool):  # a server restarted while the driver measures catches up by itself
            self.pool.catch_up = self._newest_weights
        if setup.environment is not None:  # the held-out episodes run here, on the driver's pool and fleet
            environment, verifier = PipelineEnvironment(setup, actors.runners).build(actors.fleet, actors.judge_pool)
            self.episodes = EnvironmentSource(self.pool, environment, verifier, workers=8, **setup.episode_options())
        self.metrics = PipelineMetrics(self.run_dir.resolve().name)

        before_file = self.run_dir / "reward_before.json"
        if before_file.exists():
            self.reward_before = json.loads(before_file.read_text())
        else:
            self.reward_before = self._measure()
            before_file.write_text(json.dumps(self.reward_before))

        started = actors.start_trainers(self.params)
        self.step_count = started[0]["step"]
        writers = MetricWriters(config.experiment_trackers(name=self.run_dir.resolve().name), self.run_dir,
                                start_step=self.step_count, config=config.model_dump())
        self.record.resume(self.step_count, self.reward_before, writers)  # later updates are trained again
        self._last = time.perf_counter()
        return {"restored": started[0]["restored"], "step": self.step_count, "width": plan.width,
                "reward_before": self.reward_before, "parameters": sum(int(x.size) for x in jax.tree.leaves(self.params))}

    def needs_warm_start(self) -> bool:
        """Whether ``start`` will run an SFT warm start (none has been written yet and the run asks for one)."""
        plan = self.preflight_plan()
        wanted = plan.policy.params is None or self.config.warm_start is not None
        return wanted and self.config.sft_steps > 0 and not (self.run_dir / "warm_start.msgpack").exists()

    def _warm_params(self, setup: Setup, plan: RunPlan):
        """The weights GRPO starts from: a user's model as loaded (no warm_start file), else the warm start, run
        once and read back on a rerun."""
        known = start_params(self.config, plan, self.run_dir)
        if known is not None:
            return known
        path = self.run_dir / "warm_start.msgpack"
        # in the first trainer's bundle, before the trainer starts there
        task = ray.remote(warm_start_task).options(**self.actors.placement.options("trainer", 0))
        params = ray.get(task.remote(setup, plan.built_in, plan.policy.params))
        partial = path.with_suffix(".partial")
        partial.write_bytes(serialization.to_bytes(params))
        os.replace(partial, path)  # a crash mid-write leaves no half file to read back
        return params

    def step(self, count: int = 1) -> list[dict]:
        """Train ``count`` updates on every trainer process; returns their metrics rows."""
        if not self.trainers:
            raise RuntimeError("call start() before step()")
        new = []
        while len(new) < count and self.step_count < self.config.steps:
            try:
                self.fleet.serve_requests(self.actors, self.step_count)
                self.fleet.grow(self.actors, self.step_count)
                results = step_group(self.trainers, 1)
            except RayActorError as error:  # a trainer (or its node) was lost: the run goes on from its checkpoint
                self._recover(error)
                continue
            now = time.perf_counter()
            row, verl_rows, scheduler = update_row(results, now - self._last, self.fleet.size(self.actors))
            self._last = now
            self.step_count = row["step"]
            self.record.write(row, verl_rows if self.config.verl_rows else None)
            if self.step_count % self.config.checkpoint_every == 0 or self.step_count == self.config.steps:
                try:
                    ray.get([trainer.save.remote() for trainer in self.trainers])
                except RayActorError as error:  # lost before its checkpoint held the update: trained again
                    self._recover(error)
                    new = [kept for kept in new if kept["step"] <= self.step_count]
                    continue
            self.record.keep(row)
            new.append(row)
            if self.step_count in self.config.eval_steps():
                self.record.held_out(self.step_count, self._measure())
                self._last = time.perf_counter()  # an update's wall is its own: the measurement is not part of it
            self.metrics.record({
                "reward_mean": row.get("rollout/reward/mean"), "update_step": row["updates"],
                "policy_version": scheduler.get("version"), "policy_lag": scheduler.get("lag"),
                "rollout_tokens_per_second": row.get("train/tokens", 0) / row["wall"] if row["wall"] > 0 else None,
                "trainer_wait_share": self.record.wait_share(),
                "episode_turns": row.get("rollout/episode/turns"),
                "episode_truncated_share": row.get("rollout/episode/truncated"),
                "episode_tool_errors": row.get("rollout/episode/tool_errors"),
            }, row["verdicts"])
        return new

    def _recover(self, error: RayActorError) -> None:
        """Start every actor of the run again from the newest checkpoint (what a rerun of a killed driver does, in
        this driver), at most ``restarts`` times: a lost trainer's group cannot go on without it, and servers that
        outlived it serve weights of updates its checkpoint does not hold. An actor lost while they start again (its
        node lost too) makes it start them again once more, within the same count."""
        while True:
            if 0 <= self.config.restarts <= self.recoveries:
                raise RuntimeError(f"a trainer was lost and the run has been restarted {self.recoveries} time(s) "
                                   f"already (restarts={self.config.restarts})") from error
            self.recoveries += 1
            print(f"a trainer was lost ({type(error).__name__}); starting the run's actors again from its last "
                  f"checkpoint ({self.recoveries} of {self.config.restarts if self.config.restarts >= 0 else 'any'})",
                  flush=True)
            self._stop_actors()
            try:
                started = self.start()
            except RayActorError as again:
                error = again
                continue
            print(f"resumed {self.run_dir} at update {started['step']}", flush=True)
            return

    def add_servers(self, count: int = 1) -> list[str]:
        """Start ``count`` more rollout servers, at most ``servers_max`` in all; each serves once it has loaded the
        newest weights (see :mod:`~dew_ray.pipelines.rlvr_fleet`). Returns their names."""
        return self._fleet().add(self.actors, count, self.step_count)

    def remove_servers(self, count: int = 1, timeout: float = 30.0) -> list[str]:
        """Take the ``count`` newest rollout servers out and end them, leaving at least ``servers_min``; their draws
        get ``timeout`` seconds, then are drawn again on the others. Returns their names."""
        return self._fleet().remove(self.actors, count, self.step_count, timeout)

    def _fleet(self) -> RLVRFleet:
        if self.actors is None or self.fleet is None:
            raise RuntimeError("call start() before changing the rollout fleet")
        return self.fleet

    def _newest_weights(self) -> tuple[object, int] | None:
        """The trainers' parameters and their version, for the driver's pool to bring a restarted rollout server back
        while the trainers wait on the driver (None otherwise: a trainer's next push brings it back then)."""
        with self._idle_lock:
            if not self._trainers_idle or not self.trainers:
                return None
            asked = [trainer.snapshot.remote() for trainer in self.trainers]  # a collective: every process
            version = self.step_count
        try:
            return ray.get(asked, timeout=600)[0], version
        except RayError:  # a trainer lost or silent: the step that meets it recovers the run
            return None

    def _measure(self) -> dict[str, float]:
        """The held-out reward of the policy the pool serves now (its episodes, with an environment)."""
        with self._idle_lock:
            self._trainers_idle = True
        try:
            return self._measure_now()
        finally:
            with self._idle_lock:  # any snapshot asked for was sent before the trainers' next call
                self._trainers_idle = False

    def _measure_now(self) -> dict[str, float]:
        held_out = self.plan.held_out
        if self.episodes is not None:
            return measure_episodes(self.episodes, held_out.rows, held_out.ids, self.config.eval_samples)
        return measure_reward(self.pool, pipeline_reward(self.setup, self.actors.fleet, self.actors.judge_pool),
                              self.setup.decode, held_out.rows, held_out.ids, self.config.eval_samples, self.config.max_new_tokens,
                              seed=self.config.seed + 1, eos_ids=self.setup.eos_ids)

    def finish(self) -> dict:
        """Measure the final policy on the held-out tasks, export it, plot the run and write summary.json."""
        while True:
            try:
                params = ray.get([trainer.snapshot.remote() for trainer in self.trainers])[0]  # a collective
                break
            except RayActorError as error:  # lost at the end: resumed from its checkpoint, which holds the last update
                self._recover(error)
                self.step(self.config.steps - self.step_count)
        self.pool.load(params, self.step_count)
        after = self._measure()
        if self.held_out_curve[-1]["step"] != self.step_count:
            self.record.held_out(self.step_count, after)
        policy = self.run_dir / "policy"
        self.setup.pretrained.save(params, policy)
        self.setup.tokenizer.save_pretrained(policy)
        tokens = sum(row.get("train/tokens", 0) for row in self.rows)
        wall = sum(row["wall"] for row in self.rows)
        self.summary = {
            "steps": self.step_count, "reward_before": self.reward_before, "reward_after": after,
            "held_out": self.held_out_curve,
            "wait_share": self.record.wait_share(), "rollout_tokens_per_second": tokens / wall if wall else None,
            "seconds": time.perf_counter() - self.started_at, "run_dir": str(self.run_dir.resolve()),
            "policy": str(policy.resolve()), "plot": str((self.run_dir / "rlvr.png").resolve()),
            "prompts_filtered": {"train": self.plan.train.filtered, "held_out": self.plan.held_out.filtered},
            "recoveries": self.recoveries,
            "placement": {"start": [dataclasses.asdict(where) for where in self.placement],
                          "end": [dataclasses.asdict(where) for where in self.actors.placement.where()]},
        }
        if not self.reward_before["all"] and not after["all"]:
            self.summary["note"] = zero_reward_note(self.config.model is None, self.config.sft_steps)
        plot(self.rows, self.summary, self.run_dir / "rlvr.png", f"dew-ray RLVR: {self.run_dir.name}")
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        return self.summary

    def stop(self) -> None:
        """Close the trainers and trackers, end every actor this run started, and Ray if this run started it."""
        self._stop_actors()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def _stop_actors(self) -> None:
        self.record.close()
        if self.episodes is not None:
            self.episodes.close()
            self.episodes = None
        if ray.is_initialized() and self.actors is not None:
            self.actors.stop()
            self.actors = None

    def __enter__(self) -> RLVRPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run(config: RLVRPipelineConfig, address: str | None = None) -> dict:
    """Start, train to ``config.steps`` with a progress bar, finish and stop; returns the summary."""
    with RLVRPipeline(config, address) as pipeline:
        print(f"run directory {pipeline.run_dir}", flush=True)
        print(f"sandbox for code tasks: {pipeline.preflight()}", flush=True)
        for line in pipeline.plan.describe():
            print(line, flush=True)
        if pipeline.needs_warm_start():
            print(f"warm start: {config.sft_steps} SFT steps before the first update (nothing prints until they "
                  "end; about a minute on 2 cores for the built-in decoder's 400)", flush=True)
        started = pipeline.start()
        if started["restored"]:
            print(f"resumed {pipeline.run_dir} at update {started['step']}", flush=True)
        with tqdm(total=config.steps, initial=pipeline.step_count, desc="rlvr", unit="update",
                  disable=not config.progress, file=sys.stdout) as bar:
            while pipeline.step_count < config.steps:
                (row,) = pipeline.step(1)
                bar.update(1)
                bar.set_postfix(reward=f"{row.get('rollout/reward/mean', float('nan')):.3f}",
                                lag=row.get("scheduler/lag"))
        return pipeline.finish()


def main(argv: list[str] | None = None) -> int:
    return pipeline_main(argv, __doc__.split("\n\n")[0], "a TOML file of RLVRPipelineConfig fields", load_config, run,
                         print_summary)


if __name__ == "__main__":
    # Run the imported module, not __main__: the actors unpickle this module's functions and classes by name.
    from dew_ray.pipelines.rlvr import main as _main

    sys.exit(_main())
