"""Asynchronous RLVR on Ray: trainer, rollout-server and sandbox actors, driven step by step.

    python -m dew_ray.pipelines.rlvr [--config run.toml] [--set steps=40 --set servers=2 ...] [--address ADDR]

What runs where:

- a Ray task warm-starts the built-in decoder with SFT on the tasks' demonstrations
  (:func:`dew.recipes.rlvr.warm_start`);
- ``servers`` RolloutServerActors serve it (NativeRolloutServer, continuous batching);
- ``sandbox_runners`` SandboxRunnerActors run the code tasks' programs (bubblewrap by
  default);
- ``trainers`` TrainerActors (one JAX process each; several form one jax.distributed
  job) each own a Trainer whose rollout is a RolloutScheduler over a PromptSource on
  the servers (:class:`~dew_ray.actors.ServerPool`), scored by the built-in rewards
  with code on the sandbox pool (:class:`~dew_ray.actors.RemoteFleet`); the scheduler
  publishes weights to the servers through the object store
  (:class:`~dew_ray.weights.WeightBroadcast`);
- one placement group reserves every actor's CPUs (the ``*_cpus`` fields) before any
  starts (:class:`~dew_ray.placement.RolePlacement`);
- the driver (this process) only builds the actors, steps the trainers, writes the run
  directory and sets the dashboard series (:mod:`dew_ray.metrics`).

Prompts are the built-in verifiable tasks (:mod:`dew.data.verifiable`), or verl-style
rows from ``prompts`` (a Parquet or JSONL file with ``data_source``, ``prompt``,
``reward_model.ground_truth``, ``extra_info``), encoded with the built-in character
tokenizer for the built-in decoder: rows of the code data source run in the sandbox,
every other row is scored by MathReward against its ground truth.

The run directory holds ``config.json``, ``warm_start.msgpack`` (the warm-started
weights), ``grpo/`` (the trainers' checkpoints, every ``checkpoint_every`` updates),
``metrics.jsonl`` (one line per update: trainer and scheduler metrics, the tasks
trained, wait and wall seconds), ``policy/`` (the final policy as Hugging Face
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

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

CODE_SOURCE = "dew/expression_code"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLVRPipelineConfig:
    """Options of one pipeline run; checked when built (see ``--help`` of the module for each).

    run_dir: the run directory; steps: GRPO updates; seed: tasks, initialisation and
    sampling seeds; trainers, servers, sandbox_runners: actors of each role;
    trainer_cpus, server_cpus, sandbox_cpus: Ray CPUs reserved per actor; slots: each
    server's concurrent draws; sandbox_workers: programs each runner runs at once;
    runner: "bwrap" or "process" (trusted code only); tasks_per_step: prompts per
    update; samples: completions per prompt; max_new_tokens: the response budget;
    max_lag, ahead, sync_every: the scheduler's schedule; learning_rate, clip: GRPO's
    Adam step and gradient-norm clip; sft_steps, sft_batch, sft_learning_rate: the warm start; train_tasks,
    eval_tasks, eval_samples: built-in task counts and the held-out measurement;
    prompts: a verl-style Parquet/JSONL file instead of the built-in tasks;
    checkpoint_every: updates between checkpoints; progress: the driver's progress bar.
    """

    run_dir: str = "runs/rlvr"
    steps: int = 120
    seed: int = 0
    trainers: int = 1
    servers: int = 1
    sandbox_runners: int = 1
    trainer_cpus: float = 1.0
    server_cpus: float = 1.0
    sandbox_cpus: float = 0.25
    slots: int = 64
    sandbox_workers: int = 2
    runner: str = "bwrap"
    tasks_per_step: int = 8
    samples: int = 8
    max_new_tokens: int = 32
    max_lag: int = 1
    ahead: int = 1
    sync_every: int = 1
    learning_rate: float = 3e-4
    clip: float = 1.0
    sft_steps: int = 300
    sft_batch: int = 32
    sft_learning_rate: float = 1e-2
    train_tasks: int = 2000
    eval_tasks: int = 64
    eval_samples: int = 4
    prompts: str | None = None
    checkpoint_every: int = 5
    progress: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kinds = _kinds(field.type)
            if value is None and type(None) in kinds:
                continue
            if isinstance(value, bool) and bool not in kinds:
                raise ValueError(f"config field {field.name!r} must be {_describe(kinds)}, got {value!r}")
            if not isinstance(value, tuple(kinds)) and not (float in kinds and isinstance(value, int)):
                raise ValueError(f"config field {field.name!r} must be {_describe(kinds)}, got {value!r}")
        positive = ("steps", "trainers", "servers", "sandbox_runners", "slots", "sandbox_workers", "tasks_per_step",
                    "max_new_tokens", "sync_every", "sft_batch", "train_tasks", "eval_tasks", "eval_samples",
                    "checkpoint_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"config field {name!r} must be at least 1, got {getattr(self, name)!r}")
        for name in ("trainer_cpus", "server_cpus", "sandbox_cpus", "learning_rate", "clip", "sft_learning_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"config field {name!r} must be positive, got {getattr(self, name)!r}")
        for name in ("max_lag", "ahead", "sft_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"config field {name!r} must be >= 0, got {getattr(self, name)!r}")
        if self.samples < 2:
            raise ValueError(f"config field 'samples' must be at least 2 (a group needs a baseline), got {self.samples}")
        if self.max_lag < self.ahead + self.sync_every - 1:
            raise ValueError(f"config field 'max_lag' ({self.max_lag}) must be at least ahead + sync_every - 1 "
                             f"= {self.ahead + self.sync_every - 1}: a first submission is that many updates stale")
        if self.tasks_per_step % self.trainers:
            raise ValueError(f"config field 'tasks_per_step' ({self.tasks_per_step}) must divide evenly over "
                             f"trainers={self.trainers}: each trainer process trains on its own share of the tasks")
        if self.runner not in ("bwrap", "process"):
            raise ValueError(f"config field 'runner' must be 'bwrap' or 'process', got {self.runner!r}")
        if self.prompts is not None and not Path(self.prompts).is_file():
            raise ValueError(f"config field 'prompts' names {self.prompts!r}, which is not a file")


def _kinds(annotation) -> tuple[type, ...]:
    annotation = eval(annotation, {}) if isinstance(annotation, str) else annotation  # noqa: S307 - own annotations
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(typing.get_args(annotation))
    return (annotation,)


def _describe(kinds) -> str:
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _parse(field: dataclasses.Field, text: str):
    kinds = _kinds(field.type)
    if text.lower() in ("none", "null") and type(None) in kinds:
        return None
    for kind in kinds:
        if kind is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
        elif kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                continue
        elif kind is str:
            return text
    raise ValueError(f"cannot read {text!r} as config field {field.name!r} ({_describe(kinds)})")


def load_config(path: str | Path | None = None, overrides: list[str] = (), **values) -> RLVRPipelineConfig:
    """A config from a TOML file (flat keys, or under an ``[rlvr]`` table), then ``key=value`` overrides, then ``values``."""
    fields = {field.name: field for field in dataclasses.fields(RLVRPipelineConfig)}
    merged: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as file:
            data = tomllib.load(file)
        data = data.get("rlvr", data)
        for name, value in data.items():
            if name not in fields:
                raise ValueError(f"{path}: unknown config field {name!r}; known: {sorted(fields)}")
            merged[name] = value
    for item in overrides:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"an override must read key=value, got {item!r}")
        if name not in fields:
            raise ValueError(f"unknown config field {name!r} in override {item!r}; known: {sorted(fields)}")
        merged[name] = _parse(fields[name], text)
    for name in values:
        if name not in fields:
            raise ValueError(f"unknown config field {name!r}; known: {sorted(fields)}")
    merged.update(values)
    return RLVRPipelineConfig(**merged)


# ----- what runs inside the actors ---------------------------------------------------------


@dataclasses.dataclass
class _Setup:
    """What the driver works out once and every trainer process rebuilds its job from."""

    config: RLVRPipelineConfig
    width: int
    prompt_len: int
    rows: list[dict]


def _tasks(config: RLVRPipelineConfig):
    from dew.data.verifiable import verifiable_tasks

    train = verifiable_tasks(config.train_tasks, seed=config.seed)
    held_out = verifiable_tasks(config.eval_tasks, seed=1_000_000 + config.seed)
    return train, held_out


def _prompt_rows(config: RLVRPipelineConfig, train) -> list[dict]:
    if config.prompts is None:
        from dew.data.verifiable import task_rows

        return task_rows(train)
    path = Path(config.prompts)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    for index, row in enumerate(rows):
        for name in ("data_source", "prompt"):
            if name not in row:
                raise ValueError(f"{path}: row {index} has no {name!r} field")
        if "ground_truth" not in (row.get("reward_model") or {}):
            raise ValueError(f"{path}: row {index} has no reward_model.ground_truth")
    return rows


def _reward(fleet):
    from dew.data.verifiable import MATH_SOURCE, RoutedReward, verifiable_reward

    built_in = verifiable_reward(fleet)

    class AnySource(RoutedReward):
        """The built-in routes; any other data source is scored as math against its ground truth."""

        def __call__(self, data_source, completion, ground_truth, extra_info):
            route = data_source if data_source in self.routes else MATH_SOURCE
            return self.routes[route](data_source, completion, ground_truth, extra_info)

    return AnySource(built_in.routes)


class _CountingFleet:
    """A fleet that tallies the verdicts of the programs it ran (for the dashboard)."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.verdicts: dict[str, int] = {}

    def map(self, programs):
        outcomes = self.fleet.map(programs)
        for outcome in outcomes:
            self.verdicts[outcome.verdict.name] = self.verdicts.get(outcome.verdict.name, 0) + 1
        return outcomes

    def drain(self) -> dict[str, int]:
        counts, self.verdicts = self.verdicts, {}
        return counts


def _rlvr_job(setup: _Setup, params, servers: list, runners: list):
    """The GRPO job of one trainer process (runs inside a TrainerActor)."""
    import jax
    import optax

    from dew import Trainer
    from dew.data import Loading, Prompts
    from dew.data.verifiable import task_tokenizer
    from dew.objectives.rl import GRPOObjective, PromptSource
    from dew.objectives.rl.scheduler import RolloutScheduler, prompt_tasks
    from dew.recipes.rlvr import decoder
    from dew_ray.actors import RemoteFleet, RemoteRolloutServer, ServerPool, TrainJob

    config = setup.config
    tokenizer = task_tokenizer()
    model = decoder(len(tokenizer), max_seq_len=setup.width)
    pool = ServerPool([RemoteRolloutServer(actor, name) for name, actor in servers])
    fleet = _CountingFleet(RemoteFleet(runners, workers=config.sandbox_workers))
    source = PromptSource(pool, _reward(fleet), decode=tokenizer.decode, max_new_tokens=config.max_new_tokens,
                          eos_ids=(tokenizer.eos_token_id,), workers=max(2, config.sandbox_workers * len(runners)))
    objective = GRPOObjective(model, seq_len=setup.width - 1, pretrained=params, behavior_importance=2.0)
    records: list = []
    scheduler = RolloutScheduler(
        objective, source, pool, width=setup.width, rows=config.tasks_per_step // config.trainers * config.samples,
        tasks=prompt_tasks,
        groups=config.samples, max_lag=config.max_lag, ahead=config.ahead, sync_every=config.sync_every,
        truncation="score", log=records.append,
    )
    trained: list = []

    def rollout(batch, variables, version, key):
        trained.append([task.id for task in prompt_tasks(batch)])
        return scheduler(batch, variables, version, key)

    prompts = Prompts(records=setup.rows, tokenizer=tokenizer, max_prompt_len=setup.prompt_len,
                      loading=Loading(seed=config.seed)).load(batch=config.tasks_per_step)
    optimizer = optax.chain(optax.clip_by_global_norm(config.clip), optax.adam(config.learning_rate))
    trainer = Trainer(objective, optimizer, key=jax.random.fold_in(jax.random.key(config.seed), 2),
                      rollout=rollout, progress=False, output_dir=str(Path(config.run_dir) / "grpo"))

    def report() -> dict:
        out = {"verdicts": fleet.drain(), "tasks": trained[-1] if trained else []}
        if records:
            record = records[-1]
            out["scheduler"] = {
                "version": record.version, "oldest_version": record.oldest_version, "lag": record.lag,
                "admitted_groups": record.admitted_groups, "resubmissions": record.resubmissions,
                "cancellations": record.cancellations, "abandoned_groups": record.abandoned_groups,
                "cut_groups": record.cut_groups, "waited": record.waited, "pushed": record.pushed,
                **{f"rollout/{k}": v for k, v in record.metrics.items()},
            }
        records.clear()
        return out

    def close():
        scheduler.close()
        source.close()

    return TrainJob(trainer, scheduler.tasks(prompts), close=close, report=report)


def _warm_start(config: RLVRPipelineConfig, width: int, train):
    import jax

    from dew.data.verifiable import task_tokenizer
    from dew.recipes.rlvr import decoder, warm_start

    tokenizer = task_tokenizer()
    model = decoder(len(tokenizer), max_seq_len=width)
    return warm_start(model, tokenizer, train, width, config.sft_steps, config.sft_batch, config.sft_learning_rate,
                      key=jax.random.fold_in(jax.random.key(config.seed), 1), seed=config.seed, progress=False)


# ----- the driver ----------------------------------------------------------------------------


class RLVRPipeline:
    """The driver of one run (see the module docstring); ``address`` attaches to a running cluster."""

    def __init__(self, config: RLVRPipelineConfig, address: str | None = None):
        if not isinstance(config, RLVRPipelineConfig):
            raise TypeError(f"RLVRPipeline needs an RLVRPipelineConfig, got {type(config).__name__}")
        self.config, self.address = config, address
        self.run_dir = Path(config.run_dir)
        self.rows: list[dict] = []
        self.summary: dict | None = None
        self._started_ray = False
        self._actors: list = []
        self.trainers: list = []
        self.pool = None
        self.fleet = None
        self.metrics = None
        self.placement = None
        self.step_count = 0

    # -- lifecycle --

    def start(self) -> dict:
        """Start Ray (unless attached), warm-start or read back the warm start, start every actor."""
        import ray

        from dew.data.verifiable import task_tokenizer
        from dew.inference import ServingTask
        from dew.recipes.rlvr import SANDBOX_LIMITS, decoder, sandbox_runner
        from dew.sampling import Sampling
        from dew_ray.actors import RemoteFleet, start_rollout_servers, start_sandbox_runners, start_trainer_group
        from dew_ray.metrics import PipelineMetrics
        from dew_ray.placement import RolePlacement

        config = self.config
        self.started_at = time.perf_counter()
        demand = self.cpu_demand()
        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster of this run only
            address = self.address or os.environ.get("RAY_ADDRESS")
            # A local cluster gets as many logical CPUs as the run reserves (at least the machine's cores):
            # they are scheduling tokens, and the roles share the cores as any processes do.
            cpus = None if address else max(os.cpu_count() or 1, math.ceil(sum(demand.values())))
            ray.init(address=address, num_cpus=cpus, include_dashboard=False if address is None else None,
                     log_to_driver=False, configure_logging=False)
            self._started_ray = True
        available = ray.cluster_resources().get("CPU", 0)
        if sum(demand.values()) > available:
            parts = ", ".join(f"{role} {cpus:g}" for role, cpus in demand.items())
            raise ValueError(f"the run reserves {sum(demand.values()):g} CPUs ({parts}) but the Ray cluster has "
                             f"{available:g}: lower trainer_cpus, server_cpus or sandbox_cpus, or use fewer actors")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
        self.tokenizer = tokenizer = task_tokenizer()
        train, self.held_out = _tasks(config)
        rows = _prompt_rows(config, train)
        prompt_len = max(len(tokenizer.encode(str(r["prompt"]), add_special_tokens=False)) for r in rows)
        prompt_len = max(prompt_len, *(len(tokenizer.encode(t.prompt, add_special_tokens=False)) for t in self.held_out))
        width = prompt_len + config.max_new_tokens
        answer = max(len(tokenizer.encode(t.answer, add_special_tokens=False)) + 1 for t in train)
        if config.max_new_tokens < answer:
            raise ValueError(f"config field 'max_new_tokens' ({config.max_new_tokens}) is shorter than the longest "
                             f"reference answer of the tasks ({answer} ids with EOS): the warm start could not "
                             "show it and no completion could reach it")
        self.model = decoder(len(tokenizer), max_seq_len=width)
        # Every actor's CPUs are reserved at once, in one place, before anything starts.
        self.placement = placement = RolePlacement({
            "trainer": (config.trainers, config.trainer_cpus), "rollout server": (config.servers, config.server_cpus),
            "sandbox runner": (config.sandbox_runners, config.sandbox_cpus),
        }, name=f"dew-rlvr-{self.run_dir.resolve().name}")
        self.params = self._warm_params(width, train)

        sampling = Sampling(eos_id=tokenizer.eos_token_id, temperature=1.0)
        self.pool = start_rollout_servers(ServingTask(self.model, self.params, sampling), config.servers,
                                          slots=config.slots, capacity=width, version=-1,
                                          placement=lambda i: placement.options("rollout server", i))
        runners = start_sandbox_runners(config.sandbox_runners, sandbox_runner(config.runner), SANDBOX_LIMITS,
                                        workers=config.sandbox_workers,
                                        placement=lambda i: placement.options("sandbox runner", i))
        self.fleet = RemoteFleet(runners, workers=config.sandbox_workers)
        self._actors = [server.actor for server in self.pool.servers] + runners
        self.metrics = PipelineMetrics(self.run_dir.resolve().name)

        before_file = self.run_dir / "reward_before.json"
        if before_file.exists():
            self.reward_before = json.loads(before_file.read_text())
        else:
            self.reward_before = self._measure()
            before_file.write_text(json.dumps(self.reward_before))

        setup = _Setup(config, width, prompt_len, rows)
        servers = [(server.name, server.actor) for server in self.pool.servers]
        build = functools.partial(_rlvr_job, setup, self.params, servers, runners)
        self.trainers, started = start_trainer_group(build, processes=config.trainers,
                                                     placement=lambda i: placement.options("trainer", i))
        self._actors += self.trainers
        self.step_count = started[0]["step"]
        self._read_rows(self.step_count)
        self._last = time.perf_counter()
        return {"restored": started[0]["restored"], "step": self.step_count, "width": width,
                "reward_before": self.reward_before, "parameters": sum(int(x.size) for x in _leaves(self.params))}

    def cpu_demand(self) -> dict[str, float]:
        """Ray CPUs each role reserves at once (the warm start runs before the trainers, on their share)."""
        c = self.config
        return {"trainers": c.trainers * c.trainer_cpus, "rollout servers": c.servers * c.server_cpus,
                "sandbox runners": c.sandbox_runners * c.sandbox_cpus}

    def _warm_params(self, width: int, train):
        import ray
        from flax import serialization

        from dew.recipes.rlvr import decoder

        path = self.run_dir / "warm_start.msgpack"
        template = _init_template(decoder(len(self.tokenizer), max_seq_len=width))
        if path.exists():
            return serialization.from_bytes(template, path.read_bytes())
        task = ray.remote(_warm_start).options(**self.placement.options("trainer", 0))  # before the trainer starts
        params = ray.get(task.remote(self.config, width, train))
        partial = path.with_suffix(".partial")
        partial.write_bytes(serialization.to_bytes(params))
        os.replace(partial, path)  # a crash mid-write leaves no half file to read back
        return params

    def _read_rows(self, step: int) -> None:
        """Keep the metrics rows of batches the restored checkpoint trained; later ones will be trained again."""
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        self.rows = [row for row in rows if row["step"] <= step]
        path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))

    def step(self, count: int = 1) -> list[dict]:
        """Train ``count`` updates on every trainer process; returns their metrics rows."""
        import ray

        from dew_ray.actors import step_group

        if not self.trainers:
            raise RuntimeError("call start() before step()")
        new = []
        for _ in range(count):
            if self.step_count >= self.config.steps:
                break
            results = step_group(self.trainers, 1)
            now = time.perf_counter()
            reports = [process_metrics.pop("report", {}) for (process_metrics,) in results]
            (metrics,) = results[0]
            scheduler = reports[0].get("scheduler", {})  # process 0's record; each process keeps its own
            tasks, verdicts = [], {}
            for theirs in reports:  # every process trained its own share of the batch
                tasks += theirs.get("tasks", [])
                for verdict, count in theirs.get("verdicts", {}).items():
                    verdicts[verdict] = verdicts.get(verdict, 0) + count
            wall = now - self._last
            self._last = now
            row = {"step": metrics["step"], "updates": metrics["updates"], "wall": wall,
                   "waited": scheduler.pop("waited", None), "tasks": tasks,
                   "verdicts": verdicts, **{f"train/{k}": v for k, v in metrics.items()
                                                               if k not in ("step", "updates")},
                   **{k if k.startswith("rollout/") else f"scheduler/{k}": v for k, v in scheduler.items()}}
            self.step_count = row["step"]
            # The row goes out before the checkpoint: a crash between the two retrains the update and rewrites
            # its row, where the other order would leave a trained update without one.
            with open(self.run_dir / "metrics.jsonl", "a") as file:
                file.write(json.dumps(row) + "\n")
            if self.step_count % self.config.checkpoint_every == 0 or self.step_count == self.config.steps:
                ray.get([trainer.save.remote() for trainer in self.trainers])
            self.rows.append(row)
            new.append(row)
            self.metrics.record({
                "reward_mean": row.get("rollout/reward/mean"), "update_step": row["updates"],
                "policy_version": scheduler.get("version"), "policy_lag": scheduler.get("lag"),
                "rollout_tokens_per_second": row.get("train/tokens", 0) / wall if wall > 0 else None,
                "trainer_wait_share": self.wait_share(),
            }, row["verdicts"])
        return new

    def wait_share(self) -> float | None:
        """The share of wall time after the first update that the trainer spent waiting for rollouts."""
        later = self.rows[1:]
        wall = sum(row["wall"] for row in later)
        return sum(row["waited"] or 0.0 for row in later) / wall if wall > 0 else None

    def _measure(self) -> dict[str, float]:
        """The held-out reward of the policy the pool serves now."""
        from dew.recipes.rlvr import measure_reward

        return measure_reward(self.pool, _reward(self.fleet), self.tokenizer, self.held_out, self.config.eval_samples,
                              self.config.max_new_tokens, seed=self.config.seed + 1)

    def finish(self) -> dict:
        """Measure the final policy on the held-out tasks, export it, plot the run and write summary.json."""
        import ray

        from dew.models.pretrained import Pretrained

        params = ray.get(self.trainers[0].snapshot.remote())
        self.pool.load(params, self.step_count)
        after = self._measure()
        policy = self.run_dir / "policy"
        Pretrained.from_model(self.model).save(params, policy)
        self.tokenizer.save_pretrained(policy)
        tokens = sum(row.get("train/tokens", 0) for row in self.rows)
        wall = sum(row["wall"] for row in self.rows)
        self.summary = {
            "steps": self.step_count, "reward_before": self.reward_before, "reward_after": after,
            "wait_share": self.wait_share(), "rollout_tokens_per_second": tokens / wall if wall else None,
            "seconds": time.perf_counter() - self.started_at, "run_dir": str(self.run_dir.resolve()),
            "policy": str(policy.resolve()), "plot": str((self.run_dir / "rlvr.png").resolve()),
        }
        self._plot()
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        return self.summary

    def _plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [row["step"] for row in self.rows]
        figure, (reward, speed) = plt.subplots(1, 2, figsize=(10, 3.2))
        reward.plot(steps, [row.get("rollout/reward/mean", float("nan")) for row in self.rows], marker=".")
        reward.axhline(self.reward_before["all"], color="#999999", linestyle="--", label="held-out before")
        reward.axhline(self.summary["reward_after"]["all"], color="#4477aa", linestyle="--", label="held-out after")
        reward.set_xlabel("update")
        reward.set_ylabel("mean reward of admitted rollouts")
        reward.legend()
        speed.plot(steps, [row.get("train/tokens", 0) / row["wall"] for row in self.rows], marker=".", color="#228833")
        speed.set_xlabel("update")
        speed.set_ylabel("sampled tokens trained per second")
        figure.suptitle(f"dew-ray RLVR: {self.run_dir.resolve().name}")
        figure.tight_layout()
        figure.savefig(self.run_dir / "rlvr.png", dpi=110)
        plt.close(figure)

    def stop(self) -> None:
        """Close the trainers, end every actor this run started, and Ray if this run started it."""
        import ray

        if not ray.is_initialized():
            return
        for trainer in self.trainers:
            try:
                ray.get(trainer.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - a dead trainer has nothing left to close
                pass
        for actor in self._actors:
            ray.kill(actor)
        self._actors, self.trainers = [], []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> RLVRPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _init_template(model):
    import jax
    import jax.numpy as jnp

    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def run(config: RLVRPipelineConfig, address: str | None = None) -> dict:
    """Start, train to ``config.steps`` with a progress bar, finish and stop; returns the summary."""
    from tqdm import tqdm

    with RLVRPipeline(config, address) as pipeline:
        started = pipeline.start()
        if started["restored"]:
            print(f"resumed {config.run_dir} at update {started['step']}", flush=True)
        with tqdm(total=config.steps, initial=pipeline.step_count, desc="rlvr", unit="update",
                  disable=not config.progress, file=sys.stdout) as bar:
            while pipeline.step_count < config.steps:
                (row,) = pipeline.step(1)
                bar.update(1)
                bar.set_postfix(reward=f"{row.get('rollout/reward/mean', float('nan')):.3f}",
                                lag=row.get("scheduler/lag"))
        return pipeline.finish()


def print_summary(summary: dict) -> None:
    before, after = summary["reward_before"], summary["reward_after"]
    families = ", ".join(f"{name} {before[name]:.3f} -> {after[name]:.3f}" for name in before if name != "all")
    share = summary["wait_share"]
    print(f"held-out reward {before['all']:.3f} -> {after['all']:.3f} ({families}) after {summary['steps']} updates")
    print(f"rollout tokens trained per second {summary['rollout_tokens_per_second']:.0f}; trainer waited "
          f"{'n/a' if share is None else f'{share:.1%}'} of the wall time after its first update")
    print(f"run directory {summary['run_dir']} (policy/ as Hugging Face safetensors, rlvr.png, metrics.jsonl); "
          f"{summary['seconds']:.0f} s in all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a TOML file of RLVRPipelineConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one field")
    parser.add_argument("--address", default=None, help="attach to this Ray cluster (default: RAY_ADDRESS or a "
                                                        "local cluster started for the run)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
    except (ValueError, OSError, tomllib.TOMLDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = run(config, args.address)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    # Run the imported module, not __main__: the actors unpickle this module's functions and classes by name.
    from dew_ray.pipelines.rlvr import main as _main

    sys.exit(_main())
