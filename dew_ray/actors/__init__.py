"""Ray actors over plain dew classes: trainers, rollout servers, environment workers, sandbox runners."""

from dew_ray.actors.engine import VLLMEngineActor, VLLMEngineHost, start_vllm_engines, vllm_rollouts
from dew_ray.actors.environment import (
    EnvironmentWorker,
    EnvironmentWorkerHost,
    RemoteEnvironmentSource,
    start_environment_workers,
)
from dew_ray.actors.rollout import (
    RemoteRolloutServer,
    RolloutServerActor,
    RolloutServerHost,
    ServerPool,
    start_rollout_servers,
)
from dew_ray.actors.sandbox import RemoteFleet, SandboxRunnerActor, SandboxRunnerHost, start_sandbox_runners
from dew_ray.actors.trainer import TrainerActor, TrainerHost, TrainJob, start_trainer_group, step_group

__all__ = [
    "EnvironmentWorker",
    "EnvironmentWorkerHost",
    "RemoteEnvironmentSource",
    "start_environment_workers",
    "RemoteFleet",
    "RemoteRolloutServer",
    "RolloutServerActor",
    "RolloutServerHost",
    "SandboxRunnerActor",
    "SandboxRunnerHost",
    "ServerPool",
    "start_rollout_servers",
    "start_sandbox_runners",
    "start_trainer_group",
    "step_group",
    "TrainerActor",
    "TrainerHost",
    "TrainJob",
    "VLLMEngineActor",
    "VLLMEngineHost",
    "start_vllm_engines",
    "vllm_rollouts",
]
