"""The CPU's bfloat16 weight product for few rows: a native XLA FFI kernel, built on first use.

A decode step multiplies a handful of rows by every weight of the model, so its time is
the time to read the weights. XLA's CPU dot reads bfloat16 weights at about 15 GB/s at
2 to 8 rows and converts every weight to float32 first at 1 row (8 to 10 times slower),
so serving a 0.6B model in bfloat16 was no faster than in float32. ``native_product.cc``
reads the weights once for all the rows: on CPUs with AVX512-BF16 it multiplies bfloat16
pairs (``vdpbf16ps``) for up to 32 rows, elsewhere it widens each weight to float32 for up
to 2 rows. The weight products of a 0.6B decode step at 1 row read 31 GB/s on this
machine's 2 cores, whose plain streaming read reaches 29 to 33 GB/s (README, Benchmarks).

The kernel is compiled with the machine's C++ compiler (``$CXX`` or ``c++``, with
``-march=native``) against the FFI headers jaxlib ships, the first time a process needs
it, into ``$DEW_NATIVE_HOME`` or ``~/.cache/dew-ray/native`` under a name that hashes the
source, jaxlib's version, the compiler and the CPU's flags (a shared home on machines of
different CPUs gets one build per CPU). Where there is no compiler or the build fails,
:func:`available` is False, :func:`reason` says why, and the products stay XLA's (the
same results up to the order of the sums). ``DEW_NATIVE=0`` turns the kernel off;
``DEW_NATIVE_THREADS`` sets how many threads share a product (by default the CPUs the
process may run on).

The kernel serves only the CPU: on a GPU, :func:`product` lowers to XLA's dot.
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
import jax.numpy as jnp
import jaxlib

SOURCE = Path(__file__).with_name("native_product.cc")
TARGET = "dew_bf16_product"
# Rows up to which the kernel serves, as measured on this machine (a decode step's 197 weight products at
# Qwen3-0.6B's shape, and the 12.6M bench decoder's, in one program): the paired build beats XLA's dot at
# every row count from 1 to 32 at both shapes (0.6B: 38 against 203 ms at 1 row, 76 against 112 at 8, 161
# against 197 at 32); the widening build wins at 1 and 2 rows only (at 4 it lost at 12.6M, at 8 at 0.6B).
# Prefill's packed rows (up to 256) stay with XLA's dot.
PAIRED_ROWS = 32
WIDENED_ROWS = 2

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
    """The kernel's shared library for this source, jaxlib, compiler and CPU, compiled if not there yet."""
    flags = ["-O3", "-march=native", "-std=c++20", "-pthread", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]
    digest = hashlib.sha256("\0".join(
        [SOURCE.read_text(), jaxlib.__version__, compiler, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    library = home() / f"native_product-{digest}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final name and renamed, so a process never loads another's half-written file.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                              timeout=300)
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
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.DewBf16Product), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _state["reason"] = f"the kernel did not build or load: {error}"
        return
    _state["library"] = library
    _state["rows"] = PAIRED_ROWS if library.DewPairedProducts() else WIDENED_ROWS


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    with _lock:
        if not _state:
            _load()
            if "reason" in _state:
                log.warning("dew's bfloat16 weight-product kernel is off (%s); XLA's dot serves instead",
                            _state["reason"])
    return "library" in _state


def reason() -> str | None:
    """Why the kernel is off, or None when it is on."""
    available()
    return _state.get("reason")


def max_rows() -> int:
    """The most rows a product may have to go to the kernel: 32 where it multiplies bfloat16 pairs, else 2
    (0 where the kernel is off)."""
    return _state.get("rows", 0) if available() else 0


def applies(rows: int) -> bool:
    """Whether a product of ``rows`` rows (with a weight in either layout) goes to the kernel."""
    return rows <= max_rows()


def product(x: jax.Array, weight: jax.Array, out_in: bool) -> jax.Array:
    """``x [..., in]`` (bfloat16) times a bfloat16 ``weight`` ([in, out], or [out, in] with ``out_in``): float32.

    On the CPU the native kernel (XLA's dot where it is off); on other platforms XLA's dot.
    """
    if x.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
        raise TypeError(f"native_product takes bfloat16 operands, got x {x.dtype} and weight {weight.dtype}")
    axis = 1 if out_in else 0
    if weight.ndim != 2 or x.ndim < 1 or weight.shape[axis] != x.shape[-1]:
        layout = "[out, in]" if out_in else "[in, out]"
        raise ValueError(f"native_product multiplies x [..., in] by a {layout} weight; got x {x.shape} and "
                         f"weight {weight.shape}")
    features = weight.shape[1 - axis]

    def xla(x, weight):
        return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (axis,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def native(x, weight):
        result = jax.ShapeDtypeStruct((*x.shape[:-1], features), jnp.float32)
        return jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")(x, weight, out_in=out_in)

    if not available():
        return xla(x, weight)
    return jax.lax.platform_dependent(x, weight, cpu=native, default=xla)
