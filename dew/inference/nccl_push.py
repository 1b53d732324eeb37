"""Publishing a policy to vLLM replicas by NCCL broadcast, without the disk and without torch.

``NCCLPush(pretrained, engines, library)`` is a push like
:class:`~dew.inference.safetensors_reload.SafetensorsReload`: call it with ``(variables, version)``, or
make it the push of a :class:`~dew.inference.safetensors_reload.Publication`. It sends the tensors
``Pretrained.save`` would write (``Pretrained.export``, in ``served_dtype``) from one trainer
GPU into every replica's GPUs. ``library`` is the engine's own ``libnccl.so.2``; launch vLLM
with ``--weight-transfer-config '{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``.

Followed: vLLM 0.32's ``entrypoints/rl/online/api_router.py`` (the routes),
``distributed/weight_transfer/nccl_engine.py`` and ``nccl_common.py`` (the unique-id
rendezvous for torch-free trainers: ``init_info`` with ``nccl_unique_id_b64``,
``rank_offset`` 1, ``world_size``, ``packed``) and ``packed_tensor.py`` (the packed
chunks: tensors as bytes back to back, a chunk closed once it holds more than
``packed_buffer_size_bytes``).

On the first push, for each replica, the trainer reads ``GET /server_info`` (the engine's
NCCL wheel version, which must equal ``library``'s, and its worker count), mints an NCCL
unique id, posts it to ``/init_weight_transfer_engine`` and joins the group as rank 0 at
the same time. Each push then runs, on every replica at once: ``/pause?mode=wait``,
``/start_weight_update``, ``/update_weights`` (names, dtypes, shapes) while the chunks
are broadcast, ``/finish_weight_update``, ``/reset_prefix_cache`` (which must answer
``{"success": true}``), ``/update_weight_version`` and ``/resume``. A failure after the
pause leaves the replica paused, as with the reload. A transfer that fails or stalls
aborts every group, and later pushes refuse until the replicas and the push are
restarted, since the engine's side of an aborted group cannot be reused.

A replica can be left out of pushes while it does not answer (``set_aside(url)``, which an
:class:`~dew.inference.EnginePool` with a timeout calls). A push cannot catch one replica up
on its own (it keeps no weights between pushes), so ``rejoin(url, version)`` includes the
replica in the next push again and says True once it reports ``version`` (or a later one,
in a process that has pushed nothing: another process publishes)
(``GET /weight_info``): a replica that stalls again during that push fails it, as above.
A replica's group opens at the first push that includes it. ``move(old, new)`` follows a
replica its host started again at another address: the old group is aborted, and the new
address's group opens at the first push that includes it.

Every process of a multi-process trainer calls the push: the tree is gathered to host
memory leaf by leaf (``collective_host``), and the process holding the first device
exports and sends from it; all processes agree on the outcome. Then, unless
``landing=False``, every replica must pass the landing check. ``close`` aborts the
groups (NCCL's destroy would wait for the engine's side, which the engine keeps until
it exits).

``sender`` defaults to :class:`~dew.inference.nccl.NCCLSender` over ``library``; tests on a
machine without GPUs give a stand-in with the same methods.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import jax
import numpy as np

from dew.inference.landing import LandingCheck
from dew.inference.nccl import NCCLSender
from dew.inference.safetensors_reload import (
    PAUSED,
    each_replica,
    land,
    move_replica,
    on_one_process,
    serves,
    vllm_commit,
    vllm_pause,
)
from dew.inference.wire import EngineError, expect
from dew.models.pretrained import Pretrained
from dew.sharding import collective_host
from dew.validation import integer, one_of, positive_int

DTYPES = ("bfloat16", "float32")
_NCCL_WHEEL = re.compile(r"^nvidia-nccl-cu\d+==(\d+\.\d+\.\d+)", re.MULTILINE)


def chunks(tensors: dict[str, np.ndarray], buffer_bytes: int) -> Iterator[list[str]]:
    """The names of each packed chunk, in order, cut as vLLM's consumer cuts them.

    Tensors join the open chunk until it holds more than ``buffer_bytes``; the tensor
    that crosses the bound closes it, so a chunk is at most ``buffer_bytes`` plus one tensor.
    """
    names: list[str] = []
    size = 0
    for name, value in tensors.items():
        names.append(name)
        size += value.nbytes
        if size > buffer_bytes:
            yield names
            names, size = [], 0
    if names:
        yield names


def engine_nccl(url: str, timeout: float) -> tuple[str | None, int]:
    """``(NCCL wheel version or None, worker count)`` a vLLM replica reports at ``/server_info``."""
    info = expect(f"{url}/server_info?config_format=json", method="GET", timeout=timeout,
                  rule="vLLM serves /server_info only with VLLM_SERVER_DEV_MODE=1")
    try:
        packages = info["system_env"]["pip_packages"] or ""
        parallel = info["vllm_config"]["parallel_config"]
        workers = (int(parallel["tensor_parallel_size"]) * int(parallel["pipeline_parallel_size"])
                   * int(parallel.get("data_parallel_size", 1)))
    except (KeyError, TypeError, ValueError) as error:
        raise EngineError(f"{url}: /server_info has no {error} where vLLM reports its packages and parallel "
                          "configuration") from None
    match = _NCCL_WHEEL.search(packages)
    return (match.group(1) if match else None), workers


class NCCLPush:
    """A push to vLLM replicas by NCCL broadcast (see the module docstring).

    ``buffer_bytes`` is vLLM's ``packed_buffer_size_bytes``: at most two chunks of about
    that size (or two of the largest tensor) are on the sending device at a time.
    ``published`` holds, after each push, the largest landing difference per replica.
    """

    def __init__(self, pretrained: Pretrained, engines: Sequence[str], library, *, sender=None,
                 landing: LandingCheck | bool = True, served_dtype: str = "bfloat16",
                 buffer_bytes: int = 256 * 2**20, timeout: float = 600.0):
        if not isinstance(pretrained, Pretrained):
            raise TypeError(f"pretrained must be a dew Pretrained, got {type(pretrained).__name__}")
        if isinstance(engines, str) or not engines:
            raise ValueError("engines must be a non-empty list of vLLM replica root URLs (http://host:port)")
        one_of("served_dtype", served_dtype, DTYPES)
        self.pretrained, self.served_dtype, self.timeout = pretrained, served_dtype, timeout
        self.buffer_bytes = positive_int("buffer_bytes", buffer_bytes)
        self.engines = [url.rstrip("/") for url in engines]
        self.sender = sender if sender is not None else NCCLSender(library, timeout=timeout)
        if landing is True:
            landing = LandingCheck(pretrained.model(), served_dtype=served_dtype)
        self.landing = landing or None
        self.published: dict[str, float] = {}
        self.groups: dict[str, int] = {}
        self.aside: set[str] = set()
        self.pushed = False  # whether this process has pushed (another process's pushes are not its to match)
        self._broken: str | None = None

    def __call__(self, variables, version: int) -> None:
        """Publish ``variables`` as ``version`` on every replica; every trainer process calls it."""
        integer("version", version)
        host = collective_host(variables)
        sending = jax.devices()[0].process_index
        on_one_process(f"the NCCL push of version {version}", lambda: self._publish(host, version), sending)

    def close(self) -> None:
        """Abort every group; the replicas keep serving the weights they hold."""
        for communicator in self.groups.values():
            self.sender.abort(communicator)
        self.groups = {}
        self._broken = self._broken or "the push was closed"

    def set_aside(self, url: str) -> None:
        """Leave replica ``url`` out of pushes until ``rejoin``."""
        if url not in self.engines:
            raise ValueError(f"{url} is not one of this push's replicas {self.engines}")
        self.aside.add(url)

    def rejoin(self, url: str, version: int) -> bool:
        """Include replica ``url`` in the next push; True once it reports ``version`` (see the module docstring)."""
        self.aside.discard(url)
        return serves(url, "vllm", version, self.timeout, newer=not self.pushed)

    def move(self, old: str, new: str) -> None:
        """Replica ``old`` answers at ``new`` (see the module docstring); set aside until it rejoins."""
        move_replica(self, old, new)
        communicator = self.groups.pop(old.rstrip("/"), None)
        if communicator is not None:  # the engine's side went with its process
            self.sender.abort(communicator)

    def _publish(self, variables, version: int) -> None:
        if self._broken is not None:
            raise EngineError(f"this NCCLPush cannot push version {version}: {self._broken}; restart the replicas "
                              "and make a new NCCLPush")
        targets = [url for url in self.engines if url not in self.aside]
        if not targets:
            raise EngineError(f"no replica to push version {version} to: all {len(self.engines)} are set aside")
        self.pushed = True
        tensors = self.pretrained.export(variables, self.served_dtype)
        closed = [url for url in targets if url not in self.groups]
        if closed:
            try:
                self._open(closed)
            except BaseException as error:
                if self.groups:  # a replica joined: its side of the group cannot be reused
                    self._break(f"opening the groups failed ({error})")
                raise
        each_replica(targets, self._start, f"starting the weight update of version {version}")
        self._transfer(tensors, version, targets)
        each_replica(targets, lambda url: self._finish(url, version), f"finishing the update of version {version}")
        if self.landing is not None:
            self.published = land(self.landing, targets, "vllm", self.landing.expected(variables), version,
                                  self.timeout)

    def _open(self, engines: Sequence[str]) -> None:
        """Check each replica's NCCL and join one group per replica as rank 0."""
        ours = self.sender.version()
        sizes = {}

        def check(url):
            theirs, workers = engine_nccl(url, self.timeout)
            if theirs is None:
                raise EngineError(f"{url}: the engine reports no NCCL wheel (nvidia-nccl-cu*) among its packages, so "
                                  "it cannot take part in an NCCL broadcast; use a CUDA build of vLLM, or "
                                  "SafetensorsReload")
            if theirs != ours:
                raise EngineError(f"{url}: the engine runs NCCL {theirs} and the trainer's library is NCCL {ours}; "
                                  "NCCL refuses a peer of another version: pass the engine's own libnccl.so.2")
            sizes[url] = workers + 1

        each_replica(engines, check, "checking the replicas' NCCL")
        for url in engines:
            unique_id = self.sender.unique_id()
            init_info = {"nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"), "rank_offset": 1,
                         "world_size": sizes[url], "packed": True, "packed_buffer_size_bytes": self.buffer_bytes,
                         "packed_num_buffers": 2}
            with ThreadPoolExecutor(1) as pool:  # the engine's workers block in the rendezvous we join
                answer = pool.submit(expect, f"{url}/init_weight_transfer_engine", {"init_info": init_info},
                                     timeout=self.timeout, rule="launch vLLM with --weight-transfer-config "
                                     "'{\"backend\": \"nccl\"}' and VLLM_SERVER_DEV_MODE=1")
                try:
                    self.groups[url] = self.sender.join(unique_id, sizes[url])
                finally:
                    answer.result()

    def _start(self, url: str) -> None:
        vllm_pause(url, self.timeout)
        expect(f"{url}/start_weight_update", timeout=self.timeout, rule=PAUSED)

    def _transfer(self, tensors: dict[str, np.ndarray], version: int, engines: Sequence[str]) -> None:
        """``/update_weights`` on every replica pushed to while the chunks are broadcast to their groups."""
        update_info = {"names": list(tensors), "dtype_names": [self.served_dtype] * len(tensors),
                       "shapes": [list(value.shape) for value in tensors.values()]}
        communicators = [self.groups[url] for url in engines]
        pool = ThreadPoolExecutor(len(engines))
        try:
            updates: dict[str, Future] = {
                url: pool.submit(expect, f"{url}/update_weights", {"update_info": update_info},
                                 timeout=self.timeout, rule=PAUSED)
                for url in engines}
            try:
                for names in chunks(tensors, self.buffer_bytes):
                    refused = [url for url, update in updates.items() if update.done() and update.exception()]
                    if refused:  # a receiver that already answered will never take the rest
                        raise updates[refused[0]].exception()
                    self.sender.send(communicators, np.concatenate(
                        [np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8) for name in names]))
                # A receiver answers once its last chunk is in, so a refusal is known without waiting on NCCL.
                wait(updates.values(), timeout=self.timeout, return_when=FIRST_EXCEPTION)
                failed = [update.exception() for update in updates.values() if update.done() and update.exception()]
                if failed:
                    raise failed[0] if len(failed) == 1 else EngineError("; ".join(map(str, failed)))
                if not all(update.done() for update in updates.values()):
                    raise EngineError(f"a replica did not answer /update_weights within {self.timeout:.0f} s")
                self.sender.drain(communicators)
            except BaseException as error:
                self._break(f"the transfer of version {version} failed ({error})")
                raise
        finally:  # never join a receiver still blocked in a broadcast that will not come (vLLM does the same)
            pool.shutdown(wait=False)

    def _break(self, reason: str) -> None:
        for communicator in self.groups.values():
            try:
                self.sender.abort(communicator)
            except Exception:  # the group is being given up either way
                pass
        self.groups = {}
        self._broken = reason

    def _finish(self, url: str, version: int) -> None:
        expect(f"{url}/finish_weight_update", timeout=self.timeout, rule=PAUSED)
        vllm_commit(url, version, self.timeout)
