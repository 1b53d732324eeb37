"""NCCL from ctypes, so a JAX trainer can join an inference engine's NCCL group without torch.

:class:`NCCLLibrary` binds the calls a weight broadcast needs from one ``libnccl.so.2``:
the version, the unique id, error strings, ``ncclCommInitRank``, ``ncclAllReduce``,
``ncclBroadcast`` and ``ncclCommAbort``. The signatures follow vLLM 0.32's own binding
(``vllm/distributed/device_communicators/pynccl_wrapper.py``). Load the engine's own
library: NCCL refuses a peer of another version.

:class:`NCCLSender` is rank 0 of one group per replica, on one GPU: it joins each group
(with the one-element all-reduce that vLLM's ``PyNcclCommunicator.from_unique_id_bytes``
issues right after ``ncclCommInitRank``, which a foreign peer must match), then
broadcasts byte chunks from device buffers, at most two of them resident at a time.
The CUDA calls it needs (device, stream, events) come from ``libcudart`` the same way.
The version, unique id and error strings need no device; communicators need CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections import deque
from pathlib import Path

import jax
import numpy as np

UNIQUE_ID_BYTES = 128
UINT8, FLOAT32 = 1, 7  # ncclDataType_t
SUM = 0  # ncclRedOp_t


class NCCLError(RuntimeError):
    """An NCCL or CUDA call failed; the message carries the library's own error string."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_SIGNATURES = {
    "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int],
    "ncclAllReduce": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p, ctypes.c_void_p],
    "ncclBroadcast": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p, ctypes.c_void_p],
    "ncclCommAbort": [ctypes.c_void_p],
}


def version_name(code: int) -> str:
    """NCCL's version code (``major * 10000 + minor * 100 + patch`` since 2.9) as ``"2.32.3"``."""
    major, rest = divmod(code, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


class NCCLLibrary:
    """One ``libnccl.so.2`` loaded from ``path`` (see the module docstring)."""

    def __init__(self, path):
        self.path = str(path)
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"no NCCL library at {self.path}; pass the engine's own libnccl.so.2 "
                                    "(for a pip-installed vLLM: <venv>/lib/python3.X/site-packages/nvidia/nccl/lib/)")
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as error:
            raise NCCLError(f"{self.path} does not load as a shared library: {error}") from None
        for name, arguments in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.argtypes, function.restype = arguments, ctypes.c_int
        self._lib.ncclGetErrorString.argtypes, self._lib.ncclGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p

    def error_string(self, code: int) -> str:
        return self._lib.ncclGetErrorString(code).decode()

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            raise NCCLError(f"{call} failed with NCCL error {code}: {self.error_string(code)}")

    def version_code(self) -> int:
        version = ctypes.c_int()
        self._check("ncclGetVersion", self._lib.ncclGetVersion(ctypes.byref(version)))
        return version.value

    def version(self) -> str:
        return version_name(self.version_code())

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes) that names a new group to its peers."""
        handle = _UniqueId()
        self._check("ncclGetUniqueId", self._lib.ncclGetUniqueId(ctypes.byref(handle)))
        return bytes(handle.internal)

    def init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """``ncclCommInitRank`` on the current CUDA device; blocks until every rank has joined."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        handle = _UniqueId()
        ctypes.memmove(handle.internal, unique_id, UNIQUE_ID_BYTES)
        communicator = ctypes.c_void_p()
        self._check("ncclCommInitRank",
                    self._lib.ncclCommInitRank(ctypes.byref(communicator), world_size, handle, rank))
        return communicator.value

    def all_reduce(self, communicator: int, send: int, receive: int, count: int, dtype: int, op: int,
                   stream: int) -> None:
        self._check("ncclAllReduce", self._lib.ncclAllReduce(send, receive, count, dtype, op, communicator, stream))

    def broadcast(self, communicator: int, send: int, receive: int, count: int, dtype: int, root: int,
                  stream: int) -> None:
        self._check("ncclBroadcast", self._lib.ncclBroadcast(send, receive, count, dtype, root, communicator, stream))

    def abort(self, communicator: int) -> None:
        self._check("ncclCommAbort", self._lib.ncclCommAbort(communicator))


def cuda_runtime_path() -> str:
    """``libcudart.so.12`` from the ``nvidia-cuda-runtime-cu12`` wheel JAX's CUDA plugin installs, or the system's."""
    try:
        import nvidia.cuda_runtime  # noqa: PLC0415 - optional: only a GPU trainer has it

        for root in nvidia.cuda_runtime.__path__:
            candidate = Path(root) / "lib" / "libcudart.so.12"
            if candidate.is_file():
                return str(candidate)
    except ImportError:
        pass
    found = ctypes.util.find_library("cudart")
    if found is None:
        raise NCCLError("no CUDA runtime (libcudart) on this machine: an NCCL broadcast needs a CUDA GPU")
    return found


class _CudaRuntime:
    """The few CUDA runtime calls a sender needs, from ctypes."""

    def __init__(self, path: str):
        self._lib = ctypes.CDLL(path)
        self._lib.cudaGetErrorString.restype = ctypes.c_char_p

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise NCCLError(f"{call} failed with CUDA error {code}: {self._lib.cudaGetErrorString(code).decode()}")

    def set_device(self, index: int) -> None:
        self.check("cudaSetDevice", self._lib.cudaSetDevice(index))

    def stream(self) -> int:
        stream = ctypes.c_void_p()
        self.check("cudaStreamCreateWithFlags", self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1))
        return stream.value

    def event(self, stream: int) -> int:
        event = ctypes.c_void_p()
        self.check("cudaEventCreateWithFlags", self._lib.cudaEventCreateWithFlags(ctypes.byref(event), 2))
        self.check("cudaEventRecord", self._lib.cudaEventRecord(event, ctypes.c_void_p(stream)))
        return event.value

    def done(self, event: int) -> bool:
        code = self._lib.cudaEventQuery(ctypes.c_void_p(event))
        if code == 600:  # cudaErrorNotReady
            return False
        self.check("cudaEventQuery", code)
        self.check("cudaEventDestroy", self._lib.cudaEventDestroy(ctypes.c_void_p(event)))
        return True


class NCCLSender:
    """Rank 0 of one NCCL group per replica, broadcasting byte chunks from a JAX GPU device.

    ``device`` is the JAX device to send from (the mesh's first device); it must be a
    CUDA GPU. ``send`` enqueues a chunk on every group and returns once at most two
    chunks stay resident; ``drain`` waits for the rest. Any wait longer than ``timeout``
    aborts the groups it was waiting on (NCCL's destroy would wait for the engine's side).
    """

    def __init__(self, library, device=None, *, timeout: float = 600.0, resident: int = 2):
        self.library = library if isinstance(library, NCCLLibrary) else NCCLLibrary(library)
        self.device, self.timeout, self.resident = device, timeout, resident
        self._cuda = None
        self._stream = 0
        self._in_flight: deque = deque()

    def version(self) -> str:
        return self.library.version()

    def unique_id(self) -> bytes:
        return self.library.unique_id()

    def _ready(self):
        if self._cuda is None:
            device = self.device or jax.devices()[0]
            if device.platform != "gpu":
                raise NCCLError(f"an NCCL broadcast sends from a CUDA GPU; the trainer's first device is {device}")
            self.device = device
            self._cuda = _CudaRuntime(cuda_runtime_path())
            self._cuda.set_device(device.local_hardware_id)
            self._stream = self._cuda.stream()
        self._cuda.set_device(self.device.local_hardware_id)  # CUDA's current device is per thread
        return self._cuda

    def join(self, unique_id: bytes, world_size: int) -> int:
        """Rank 0's communicator of the group ``unique_id`` names, after vLLM's one-element warm-up all-reduce."""
        cuda = self._ready()
        communicator = self.library.init_rank(world_size, unique_id, 0)
        scratch = jax.device_put(np.zeros(1, np.float32), self.device)
        scratch.block_until_ready()
        pointer = scratch.unsafe_buffer_pointer()
        self.library.all_reduce(communicator, pointer, pointer, 1, FLOAT32, SUM, self._stream)
        self._wait(cuda.event(self._stream), [communicator])
        return communicator

    def send(self, communicators: list[int], chunk: np.ndarray) -> None:
        cuda = self._ready()
        while len(self._in_flight) >= self.resident:
            self._wait(self._in_flight[0][1], communicators)
            self._in_flight.popleft()
        buffer = jax.device_put(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1), self.device)
        buffer.block_until_ready()  # XLA's stream is not the one NCCL reads on
        pointer = buffer.unsafe_buffer_pointer()
        for communicator in communicators:
            self.library.broadcast(communicator, pointer, pointer, buffer.size, UINT8, 0, self._stream)
        self._in_flight.append((buffer, cuda.event(self._stream)))

    def drain(self, communicators: list[int]) -> None:
        while self._in_flight:
            self._wait(self._in_flight[0][1], communicators)
            self._in_flight.popleft()

    def _wait(self, event: int, communicators: list[int]) -> None:
        deadline = time.monotonic() + self.timeout
        while not self._cuda.done(event):
            if time.monotonic() > deadline:
                for communicator in communicators:
                    self.abort(communicator)
                self._in_flight.clear()
                raise NCCLError(f"an NCCL transfer did not finish within {self.timeout:.0f} s; its groups were aborted")
            time.sleep(0.001)

    def abort(self, communicator: int) -> None:
        self.library.abort(communicator)


def bundled_library() -> str | None:
    """The ``libnccl.so.2`` of the ``nvidia-nccl-cu12`` wheel in this environment, if it has one."""
    try:
        import nvidia.nccl  # noqa: PLC0415 - optional wheel
    except ImportError:
        return None
    for root in nvidia.nccl.__path__:
        candidate = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.isfile(candidate):
            return candidate
    return None
