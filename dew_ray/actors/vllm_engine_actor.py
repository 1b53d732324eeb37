"""vLLM engines owned by Ray actors, and the rollout server that draws from them.

``VLLMEngineHost`` launches a vLLM server process (:class:`~dew.inference.VLLMEngine`, from
the engine environment) on the node Ray places the actor on, with the actor's resources:
Ray sets the GPUs the actor holds in its environment (``CUDA_VISIBLE_DEVICES``), which the
engine inherits, and on CPU the engine's threads are bounded by the actor's CPUs. The
engine is health-checked (``healthy``), and killed with the actor: ``close`` kills its
process group, and so does the engine's guard when the actor's process dies
(``VLLMEngine``'s ``PR_SET_PDEATHSIG`` guard), so a killed actor leaves no engine process behind.
``VLLMEngineActor = ray.remote(VLLMEngineHost)``.

Draws do not pass through the actor: :func:`vllm_rollouts` builds, in whatever process
trains or measures, an :class:`~dew.inference.EnginePool` of
:class:`~dew.inference.OpenAIRolloutServer`s that post straight to the engines' URLs (an
engine started elsewhere works the same way: pass its URL), all publishing through one
:class:`~dew.inference.Publication` over a :class:`~dew.inference.SafetensorsReload` on the
directory the engines were launched on.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from dew.inference import (
    EnginePool,
    NCCLPush,
    OpenAICompletion,
    OpenAIRolloutServer,
    Publication,
    SafetensorsReload,
    VLLMEngine,
    engine_client,
)
from dew.inference.wire import authorize
from dew.models.pretrained import Pretrained
from dew.sampling import Sampling
from dew.validation import positive_int

class VLLMEngineHost:
    """A vLLM server process on this node (see the module docstring); ``url()`` is its root."""

    def __init__(self, model: str, name: str = "dew", dtype: str = "float32", max_model_len: int = 256,
                 args: Sequence[str] = (), threads: int | None = None, host: str | None = None, **options):
        if threads is None and ray.is_initialized():
            threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        # The engine is reached from other nodes' trainers: listen on this node's address unless told otherwise
        # (VLLMEngine then asks for api_key, which every route but /health requires).
        host = host or (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1")
        self.engine = VLLMEngine(model, name=name, dtype=dtype, max_model_len=max_model_len, args=args, env=env,
                                 host=host, **options)

    def url(self) -> str:
        return self.engine.url

    def process_group(self) -> int:
        """The engine's process group (its guard leads it): every vLLM process of this engine is in it."""
        return self.engine.process.pid

    def healthy(self) -> bool:
        return self.engine.healthy()

    def log_tail(self, lines: int = 40) -> str:
        return self.engine.log_tail(lines)

    def close(self) -> None:
        self.engine.close()


VLLMEngineActor = ray.remote(VLLMEngineHost)


def start_vllm_engines(model: str, count: int, *, name: str = "dew", placement=None, num_cpus: float = 1,
                       **engine) -> tuple[list, list[str]]:
    """``count`` VLLMEngineActors on ``model``; returns the actors and their engines' URLs once all answer.

    ``placement(i)``, when given, returns actor i's options (its resources and placement-group bundle).
    """
    positive_int("count", count)
    actors = [VLLMEngineActor.options(**(placement(i) if placement else {"num_cpus": num_cpus}))
              .remote(model, name=name, **engine) for i in range(count)]
    urls = ray.get([actor.url.remote() for actor in actors])  # the constructors wait for /health
    return actors, urls


def vllm_rollouts(pretrained: Pretrained, directory: str, urls: Sequence[str], sampling: Sampling, *,
                  name: str = "dew", version: int = 0, served_dtype: str = "float32",
                  nccl_library: str | None = None, timeout: float | None = None,
                  api_key: str | None = None) -> EnginePool:
    """Rollouts from vLLM engines at ``urls`` serving ``directory``, published by a SafetensorsReload there,
    or, with ``nccl_library`` (the engines' own ``libnccl.so.2``), by an NCCLPush from this process's first GPU;
    ``timeout``: the EnginePool's (how long an engine may answer nothing before it is set aside);
    ``api_key``: the engines' key (``VLLMEngine(api_key=...)``), sent with every call this process makes to them.

    The engines must run with ``--logprobs-mode processed_logprobs`` when ``sampling``
    transforms (OpenAIRolloutServer's rule), and with ``--weight-transfer-config
    '{"backend": "nccl"}'`` for the NCCL push; the publisher checks every push landed.
    """
    for url in urls if api_key is not None else ():
        authorize(url, api_key)
    if nccl_library is not None:
        push = NCCLPush(pretrained, list(urls), nccl_library, served_dtype=served_dtype)
    else:
        push = SafetensorsReload(pretrained, directory, list(urls), "vllm", served_dtype=served_dtype)
    publication = Publication(push, version=version)
    return EnginePool([
        OpenAIRolloutServer(OpenAICompletion(name, engine_client(url)), sampling, publication, processed_logprobs=True)
        for url in urls
    ], timeout=timeout)
