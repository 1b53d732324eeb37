"""dew's native CPU kernels: one shared library of XLA FFI handlers, built on first use.

The library holds the bfloat16 weight product of decode steps (``native_product.cc``, used
through :mod:`dew.models.native_product`) and a decode step's attention
(``native_attention.cc``, through :mod:`dew.models.native_attention`); both share the helper
threads of ``native_threads.h``.

It is compiled with the machine's C++ compiler (``$CXX`` or ``c++``, with ``-march=native``)
against the FFI headers jaxlib ships, the first time a process needs it, into
``$DEW_NATIVE_HOME`` or ``~/.cache/dew-ray/native`` under a name that hashes the sources,
jaxlib's version, the compiler and the CPU's flags (a shared home on machines of different
CPUs gets one build per CPU). Where there is no compiler or the build fails, :func:`available`
is False, :func:`reason` says why, and every kernel's work stays with XLA (the same results up
to the order of the sums). ``DEW_NATIVE=0`` turns the kernels off; ``DEW_NATIVE_THREADS`` sets
how many threads share a kernel's call (by default the CPUs the process may run on).

The kernels serve only the CPU: on other platforms their callers lower to XLA's operations.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

HERE = Path(__file__).parent
SOURCES = (HERE / "native_product.cc", HERE / "native_attention.cc")
HEADERS = (HERE / "native_threads.h",)
# FFI target names and the library's handler symbols
TARGETS = {"dew_bf16_product": "DewBf16Product", "dew_decode_attention": "DewDecodeAttention"}

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {}


def home() -> Path:
    return Path(os.environ.get("DEW_NATIVE_HOME") or Path.home() / ".cache" / "dew-ray" / "native")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    """The kernels' shared library for these sources, jaxlib, compiler and CPU, compiled if not there yet."""
    flags = ["-O3", "-march=native", "-std=c++20", "-pthread", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
             f"-I{HERE}"]
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256("\0".join(
        [*texts, jaxlib.__version__, compiler, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    library = home() / f"native-{digest}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final name and renamed, so a process never loads another's half-written file.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(built, library)
    return library


def _load() -> None:
    if os.environ.get("DEW_NATIVE", "1") == "0":
        _state["reason"] = "DEW_NATIVE=0"
        return
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        _state["reason"] = "no C++ compiler (c++, g++ or clang++; or $CXX) on the PATH"
        return
    try:
        library = ctypes.CDLL(str(_build(compiler)))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _state["reason"] = f"the kernels did not build or load: {error}"
        return
    _state["library"] = library


def available() -> bool:
    """Whether the kernels are built and registered (building them on the first call)."""
    with _lock:
        if not _state:
            _load()
            if "reason" in _state:
                log.warning("dew's native CPU kernels are off (%s); XLA's operations serve instead", _state["reason"])
    return "library" in _state


def reason() -> str | None:
    """Why the kernels are off, or None when they are on."""
    available()
    return _state.get("reason")


def paired_products() -> bool:
    """Whether the weight-product kernel multiplies bfloat16 pairs (AVX512-BF16); False where the kernels are off."""
    return available() and bool(_state["library"].DewPairedProducts())
