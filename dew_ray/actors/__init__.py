"""Ray actors over plain dew classes: trainers, rollout servers, vLLM engines, environment workers, sandbox runners.

One module per actor (``trainer_actor``, ``rollout_server_actor``, ``vllm_engine_actor``,
``environment_worker``, ``sandbox_runner_actor``), each with the client the trainer process
uses; the clients that spread work over several actors are :class:`~dew.inference.ReplicaPool`
s (``actor_replicas``: a pool of actors, each left out once Ray says it died). ``keyed_calls``:
the calls an async actor can be told to cancel before they arrive.
"""

from dew_ray.actors.vllm_engine_actor import VLLMEngineActor, VLLMEngineHost, start_vllm_engines, vllm_rollouts
from dew_ray.actors.environment_worker import (
    EnvironmentWorker,
    EnvironmentWorkerHost,
    RemoteEnvironmentSource,
    start_environment_workers,
)
from dew_ray.actors.rollout_server_actor import (
    RemoteRolloutServer,
    RolloutServerActor,
    RolloutServerHost,
    ServerPool,
    server_pool,
    start_rollout_servers,
)
from dew_ray.actors.sandbox_runner_actor import RemoteFleet, SandboxRunnerActor, SandboxRunnerHost, start_sandbox_runners
from dew_ray.actors.trainer_actor import TrainerActor, TrainerHost, TrainJob, start_trainer_group, step_group

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
    "server_pool",
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
