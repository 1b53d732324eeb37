"""SFT -> DPO -> GRPO stages on Ray: one trainer group per stage, the policy handed on through the object store.

    python -m dew_ray.pipelines.chain --config chain.toml [--set run_dir=...] [--address ADDR]
    dew-ray chain --config chain.toml
    ray job submit --working-dir . -- python -m dew_ray.pipelines.chain --config chain.toml --set run_dir=$PWD/runs/c

The configuration (:class:`ChainConfig`, read by the shared loader) names a Hugging Face model
directory, the chain's batch, learning rate, seed and trainer processes, and ``[[stages]]``
tables (:class:`~dew.recipes.stage_files.StageSpec`: name, kind "sft"/"dpo"/"grpo", data file
and the stage's options), as ``dew-ray sft|dpo|grpo`` read them:

    model = "/models/qwen3-0.6b"
    run_dir = "/shared/runs/chain"
    batch = 8
    [[stages]]
    name = "sft"
    kind = "sft"
    data = "/data/chat.parquet"
    steps = 200

Each stage starts its own group of ``trainers`` TrainerActors (one ``jax.distributed`` job)
whose Trainer has a fresh optimizer and step counter in ``<run_dir>/<name>/``, starting from the
previous stage's final policy (the first from the model directory's weights); DPO and GRPO
freeze that start as their reference. The previous policy reaches the new group as an object
in Ray's object store, fetched inside the trainer processes; the driver only passes the
reference along. After its last step a stage checkpoints, puts its policy in the object store
and a Ray task writes it to ``<run_dir>/<name>/policy/`` as Hugging Face safetensors with the
tokenizer; then the group ends. ``<run_dir>/<name>/metrics.jsonl`` has a line per step.
Running again on the same run directory restores every stage's newest checkpoint: finished
stages train nothing, an unfinished one continues from its checkpoint (``checkpoint_every``).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import jax
import ray
from pydantic import Field, model_validator

from dew.config import load_config
from dew.validation import distinct
from dew.experiment_trackers import MetricWriters, TrackerOptions
from dew.recipes.stage_files import (
    ModelOptions,
    StageSpec,
    check_context,
    decoding,
    export_policy,
    stage_of,
)
from dew.recipes.run_inputs import model_tokenizer
from dew.recipes.stage_chain import stage_trainer
from dew_ray.actors import start_trainer_group, step_group
from dew_ray.actors.trainer_actor import TrainJob
from dew_ray.pipelines.run_dirs import PreflightError, pipeline_main, resolve_run_dir, start_ray, writable

__all__ = ["ChainConfig", "ChainPipeline", "main", "run"]


class ChainConfig(ModelOptions, TrackerOptions):
    """A chain of stages on Ray (see the module docstring): the model and optimizer settings of
    :class:`~dew.recipes.stage_files.ModelOptions`, and

    run_dir: the run directory; trainers: processes per stage group, trainer_cpus: CPUs each reserves;
    checkpoint_every: steps between checkpoints within a stage (and one at its end).
    trackers, wandb_project, wandb_mode: experiment trackers for each stage's rows
    (:class:`dew.experiment_trackers.TrackerOptions`): TensorBoard event files in
    ``<run_dir>/<name>/tensorboard``, one W&B run per stage, grouped by the run directory.
    """

    run_dir: str = "runs/chain"
    trainers: int = Field(default=1, ge=1)
    trainer_cpus: float = Field(default=1, gt=0)
    checkpoint_every: int = Field(default=50, ge=1)
    progress: bool = True
    stages: list[StageSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct(self):
        distinct("stage names", [stage.name for stage in self.stages], why="they label their directories")
        return self


def stage_job(config: ChainConfig, index: int, run_dir: str, start: list | None) -> TrainJob:
    """Inside a trainer process: stage ``index``'s Trainer and Dataset, from ``start`` (a one-item list holding the
    previous stage's policy as an object reference; None for the model directory's weights)."""
    spec = config.stages[index]
    tokenizer = model_tokenizer(config.model, config.tokenizer)
    # a later stage starts from the previous policy: the directory's weights are read for the first stage only
    model, variables = config.load_model(weights=start is None)
    variables = variables if start is None else ray.get(start[0])
    check_context(spec, spec.kind, model, config.model)
    stage = stage_of(spec, spec.kind, spec.name, tokenizer)
    trainer, data = stage_trainer(model, config.optimizer(),
                                  jax.random.fold_in(jax.random.key(config.seed), index + 1),
                                  Path(run_dir) / spec.name, config.batch, stage, variables, False,
                                  **(decoding(tokenizer) if spec.kind == "grpo" else {}), parallelism=config.parallelism())
    return TrainJob(trainer, data)


@ray.remote(num_cpus=1)
def write_policy(model: str, tokenizer: str | None, policy: list, directory: str) -> str:
    """A Ray task: the stage's policy (fetched from the object store) as Hugging Face safetensors."""
    return str(export_policy(model, ray.get(policy[0]), directory, model_tokenizer(model, tokenizer)))


class ChainPipeline:
    """The driver of one chain (see the module docstring); ``address`` attaches to a running cluster."""

    def __init__(self, config: ChainConfig, address: str | None = None):
        if not isinstance(config, ChainConfig):
            raise TypeError(f"ChainPipeline needs a ChainConfig, got {type(config).__name__}")
        self.config, self.address = config, address
        self.run_dir = resolve_run_dir(config.run_dir)
        self.summary: dict = {"stages": []}
        self._started_ray = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        writable(self.run_dir)
        for spec in self.config.stages:
            if not Path(spec.data).expanduser().exists():
                raise PreflightError(f"stage {spec.name!r}: config field 'data' {spec.data} does not exist")
        if not (Path(self.config.model).expanduser() / "config.json").exists():
            raise PreflightError(f"config field 'model' must be a Hugging Face model directory with config.json, "
                                 f"got {self.config.model}")
        if not ray.is_initialized():
            start_ray(self.address, self.config.trainers * self.config.trainer_cpus + 1)
            self._started_ray = True
        (self.run_dir / "config.json").write_text(json.dumps({**self.config.model_dump(),
                                                              "run_dir": str(self.run_dir)}, indent=2))

    def run_stages(self, progress=print) -> dict:
        """Train every stage in turn; returns the summary (also written to ``<run_dir>/summary.json``)."""
        config, previous = self.config, None
        for index, spec in enumerate(config.stages):
            began = time.perf_counter()
            build = functools.partial(stage_job, config, index, str(self.run_dir), previous)
            actors, started = start_trainer_group(build, processes=config.trainers, num_cpus=config.trainer_cpus)
            writers = None
            try:
                done = started[0]["step"]
                metrics = self.run_dir / spec.name / "metrics.jsonl"
                kept = [line for line in (metrics.read_text().splitlines() if metrics.exists() else [])
                        if json.loads(line)["step"] <= done]  # lines past the restored checkpoint are trained again
                metrics.parent.mkdir(parents=True, exist_ok=True)
                metrics.write_text("".join(line + "\n" for line in kept))
                writers = MetricWriters(config.experiment_trackers(name=spec.name, group=self.run_dir.name),
                                        self.run_dir / spec.name, start_step=done, config=config.model_dump())
                progress(f"stage {spec.name} ({spec.kind}): {'restored at step ' + str(done) if started[0]['restored'] else 'from the previous policy'}, "
                         f"{spec.steps - done} steps to go")
                while done < spec.steps:
                    count = min(config.checkpoint_every - done % config.checkpoint_every, spec.steps - done)
                    rows = step_group(actors, count)[0]
                    with open(metrics, "a") as handle:
                        for row in rows:
                            handle.write(json.dumps({k: v for k, v in row.items() if k != "report"}) + "\n")
                            writers.write(row["step"], {k: v for k, v in row.items() if k not in ("report", "step")},
                                          "train/")
                    done = rows[-1]["step"]
                    ray.get([actor.save.remote() for actor in actors])
                    progress(f"stage {spec.name}: step {done}/{spec.steps}, loss {rows[-1].get('loss', float('nan')):.4f}")
                # every process gathers (a collective); process 0's copy goes to the object store, the driver keeps
                # the reference only, made before the group ends (its CPUs then go to the export)
                policy, *others = [actor.snapshot.remote() for actor in actors]
                ray.wait([policy, *others], num_returns=len(actors), fetch_local=False)
            finally:
                if writers is not None:
                    writers.close()
                ray.get([actor.close.remote() for actor in actors])
                for actor in actors:
                    ray.kill(actor)
            directory = ray.get(write_policy.remote(config.model, config.tokenizer, [policy],
                                                    str(self.run_dir / spec.name / "policy")))
            previous = [policy]
            self.summary["stages"].append({"name": spec.name, "kind": spec.kind, "steps": spec.steps,
                                           "restored": started[0]["restored"], "policy": directory,
                                           "seconds": round(time.perf_counter() - began, 1)})
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        return self.summary

    def stop(self) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def run(config: ChainConfig, address: str | None = None) -> dict:
    with ChainPipeline(config, address) as pipeline:
        print(f"run directory {pipeline.run_dir}", flush=True)
        pipeline.start()
        return pipeline.run_stages(lambda line: print(line, flush=True))


def report(summary: dict) -> None:
    for stage in summary["stages"]:
        print(f"{stage['name']} ({stage['kind']}): {stage['steps']} steps, {stage['seconds']} s, policy {stage['policy']}")


def main(argv: list[str] | None = None) -> int:
    return pipeline_main(argv, __doc__.split("\n\n")[0], "a TOML file of ChainConfig fields with [[stages]] tables",
                         lambda path, overrides: load_config(ChainConfig, path, overrides, table="chain"), run, report)


if __name__ == "__main__":
    # Run the imported module, not __main__: the actors unpickle this module's functions by name.
    from dew_ray.pipelines.chain import main as _main

    sys.exit(_main())
