"""``dew-ray replay RUN_DIR``: the RLVR pipeline's run trained again from its record, bit for bit.

A run with ``record=true`` (the default) writes the batch each update trained on in
``<run_dir>/record/`` (:mod:`dew.update_record`). :func:`replay_run` rebuilds the run's
trainer from ``config.json`` (the same model, the weights GRPO started from: the warm start
of ``warm_start.msgpack`` or the user's model, the objective, optimizer, key and mesh) on the
number of devices the trainer had, without starting Ray, a rollout server, a sandbox or an
engine, and hands it to :func:`dew.replay.replay`, which trains every recorded batch again
and compares the parameters with the record's digest after each update and with each
checkpoint still in ``<run_dir>/grpo/`` bit for bit. The same holds for every engine and
for multi-turn environments: the trainer consumed the same kind of batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from dew.recipes.rlvr_plan import plan_run
from dew.recipes.rlvr_recipe import grpo_objective, grpo_trainer, packed_shape
from dew.replay import ReplayReport, replay
from dew.update_record import RecordError, UpdateRecord
from dew_ray.actors.trainer_actor import use_cpu_devices
from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig
from dew_ray.pipelines.rlvr_job import start_params


def replay_run(run_dir: str | Path, until: int | None = None) -> ReplayReport:
    """Train the run in ``run_dir`` again from its record (see the module docstring); ``until``: only the first
    ``until`` steps. Raises RecordError for a run without a usable record."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise RecordError(f"{run_dir} is not the directory of a dew-ray rlvr run (it has no config.json)")
    record = UpdateRecord(run_dir / "record")
    start = record.start()
    if start["platform"] == "cpu":  # before JAX starts its backend: the trainer's devices, as the run had them
        use_cpu_devices(start["local_devices"])
    config = RLVRPipelineConfig.model_validate({**json.loads((run_dir / "config.json").read_text()),
                                                "run_dir": str(run_dir), "progress": False})
    plan = plan_run(config)
    params = start_params(config, plan, run_dir)
    if params is None:
        raise RecordError(f"{run_dir} has no warm_start.msgpack: the weights the run's GRPO started from are missing")
    width, _, layout = packed_shape(config, plan.width, plan.prompt_len,
                                    config.share_prompts and config.environment is None, plan.policy.model)
    trainer = grpo_trainer(config, grpo_objective(config, plan.policy.model, params, width, layout), progress=False)
    return replay(trainer, record, checkpoints=run_dir / "grpo", until=until)
