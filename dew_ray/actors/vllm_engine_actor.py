"""vLLM engines owned by Ray actors, and the rollout server that draws from them.

``VLLMEngineHost`` launches a vLLM server process (:class:`~dew.inference.VLLMEngine`, from
the engine environment) on the node Ray places the actor on, with the actor's resources:
Ray sets the GPUs the actor holds in its environment (``CUDA_VISIBLE_DEVICES``), which the
engine inherits, and on CPU the engine's threads are bounded by the actor's CPUs. The
engine is health-checked (``healthy``), and killed with the actor: ``close`` kills its
process group, and so does the engine's guard when the actor's process dies
(``VLLMEngine``'s ``PR_SET_PDEATHSIG`` guard), so a killed actor leaves no engine process behind.
``VLLMEngineActor = ray.remote(VLLMEngineHost)``.

An engine comes back: when its process exits (a crash, a kill), the host's next ``url()``
starts it again on the same model directory; when the actor itself is lost (its process or
its node), Ray restarts it (``max_restarts``) and its constructor starts a new engine, on
whatever node its placement-group bundle lands. Either way the engine listens at a new
address, which ``url()`` answers.

Draws do not pass through the actor: :func:`vllm_rollouts` builds, in whatever process
trains or measures, an :class:`~dew.inference.EnginePool` of
:class:`~dew.inference.OpenAIRolloutServer`s that post straight to the engines' URLs (an
engine started elsewhere works the same way: pass its URL), all publishing through one
:class:`~dew.inference.Publication` over a :class:`~dew.inference.SafetensorsReload` on the
directory the engines were launched on. Given the hosts too, the pool finds an engine that
came back by asking its host's ``url()`` (the EnginePool's ``locate``), catches it up on the
newest weights and draws from it again.
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
from dew.inference.safetensors_reload import served_version
from dew.inference.wire import authorize
from dew.models.pretrained import Pretrained
from dew.sampling import Sampling
from dew.validation import positive_int
from dew_ray.actors.actor_replicas import answer

ENGINE_START = 300.0  # seconds an engine may take to start (VLLMEngine's startup_timeout): a pool waits as long


class VLLMEngineHost:
    """A vLLM server process on this node (see the module docstring); ``url()`` is its root, wherever it is now."""

    def __init__(self, model: str, name: str = "dew", dtype: str = "float32", max_model_len: int = 256,
                 args: Sequence[str] = (), threads: int | None = None, host: str | None = None, **options):
        if threads is None and ray.is_initialized():
            threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        # The engine is reached from other nodes' trainers: listen on this node's address unless told otherwise
        # (VLLMEngine then asks for api_key, which every route but /health requires).
        host = host or (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1")
        self.launch = dict(model=model, name=name, dtype=dtype, max_model_len=max_model_len, args=args, env=env,
                           host=host, **options)
        self.engine = VLLMEngine(**self.launch)

    def url(self) -> str:
        """The engine's root URL; an engine whose process has exited is started again first (a new port)."""
        if self.engine.process.poll() is not None:
            self.engine.close()  # what is left of its process group goes
            self.engine = VLLMEngine(**self.launch)
        return self.engine.url

    def serving(self) -> tuple[int, bool]:
        """What the engine serves, as a RolloutServerHost answers: (the weight version it reports, whether that is
        no pushed version). An engine launched or started again on the directory reports vLLM's "default" (stale)
        until a push or a pool's catch-up stamps a version."""
        served = served_version(self.url(), "vllm", 10)  # this process holds the engine's key
        try:
            return int(served), False
        except (TypeError, ValueError):
            return -1, True

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
                       max_restarts: int = 0, **engine) -> tuple[list, list[str]]:
    """``count`` VLLMEngineActors on ``model``; returns the actors and their engines' URLs once all answer.

    ``placement(i)``, when given, returns actor i's options (its resources and placement-group bundle);
    ``max_restarts``: how often Ray starts a lost actor again (and with it its engine).
    """
    positive_int("count", count)
    actors = [VLLMEngineActor.options(**(placement(i) if placement else {"num_cpus": num_cpus}),
                                      max_restarts=max_restarts)
              .remote(model, name=name, **engine) for i in range(count)]
    urls = ray.get([actor.url.remote() for actor in actors])  # the constructors wait for /health
    return actors, urls


def vllm_rollouts(pretrained: Pretrained, directory: str, urls: Sequence[str], sampling: Sampling, *,
                  name: str = "dew", version: int = 0, served_dtype: str = "float32",
                  nccl_library: str | None = None, timeout: float | None = None,
                  api_key: str | None = None, hosts: Sequence | None = None) -> EnginePool:
    """Rollouts from vLLM engines at ``urls`` serving ``directory``, published by a SafetensorsReload there,
    or, with ``nccl_library`` (the engines' own ``libnccl.so.2``), by an NCCLPush from this process's first GPU;
    ``timeout``: the EnginePool's (how long an engine may answer nothing before it is set aside);
    ``api_key``: the engines' key (``VLLMEngine(api_key=...)``), sent with every call this process makes to them;
    ``hosts``: the VLLMEngineActors of ``urls``, one each, asked where an engine that came back answers.

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
    locate = None
    if hosts is not None:
        if len(hosts) != len(urls):
            raise ValueError(f"vllm_rollouts needs one host per engine URL: got {len(hosts)} for {len(urls)}")

        def locate(index: int, wait: float | None) -> str | None:
            url = answer(hosts[index].url.remote(), f"vLLM engine host {index}", wait)
            if url is not None and api_key is not None:
                authorize(url, api_key)  # the key goes with the engine to its new address
            return url

    return EnginePool([
        OpenAIRolloutServer(OpenAICompletion(name, engine_client(url)), sampling, publication, processed_logprobs=True)
        for url in urls
    ], timeout=timeout, locate=locate, wait=ENGINE_START if hosts is not None else None)
