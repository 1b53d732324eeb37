"""ContainerRunner: each program in a fresh Docker or Podman container (what it isolates: ``dew.sandbox.runners``)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import uuid

from dew.sandbox.launcher import BASE_ENVIRONMENT, kill_group, rlimit_argv
from dew.sandbox.program import Program, SandboxLimits
from dew.sandbox.runners import NOBODY, CapturingRunner
from dew.validation import integer


class ContainerRunner(CapturingRunner):
    """A fresh container per program through ``runtime`` (docker or podman); the image must already be present.

    See the module docstring for what it isolates. The runtime CLI's rusage does not cover
    the container, so a SIGKILL the runner did not send is classified by asking the
    runtime whether the OOM killer ended it (CRASHED) or not (RLIMIT_CPU's hard limit:
    TIMEOUT; a program that SIGKILLs itself is reported so too). Containers are named
    ``dew-sandbox-<16 hex>`` and removed after each program.

    cpu_shares: the container's relative CPU weight (``--cpu-shares``).
    scratch_bytes: size of the writable tmpfs at /tmp (HOME and TMPDIR).
    """

    job_owner = NOBODY
    status_signals = True

    def __init__(self, image: str, runtime: str = "docker", *, cpu_shares: int = 1024, scratch_bytes: int = 64 << 20):
        if not isinstance(image, str) or not image:
            raise ValueError(f"image must be a non-empty image name, got {image!r}")
        if not isinstance(runtime, str) or not runtime:
            raise ValueError(f"runtime must be a command such as 'docker' or 'podman', got {runtime!r}")
        for name, value in (("cpu_shares", cpu_shares), ("scratch_bytes", scratch_bytes)):
            integer(f"{name}", value, at_least=2)
        found = shutil.which(runtime)
        if found is None:
            raise RuntimeError(f"the container runtime {runtime!r} is not on PATH; install Docker (apt-get install "
                               "docker.io; tools/container_env.py does it and starts the daemon) or Podman")
        self.image, self.runtime, self.cpu_shares, self.scratch_bytes = image, runtime, cpu_shares, scratch_bytes
        self.runtime_path = found  # for the watchers, which run with a minimal PATH of their own
        self.setpriv = shutil.which("setpriv", path=BASE_ENVIRONMENT["PATH"])

    def describe(self) -> str:
        """Which runtime and image run the programs: "docker 28.2.2, server 20.10.24, image dew-ray/base:bookworm"."""
        found = subprocess.run([self.runtime, "version", "--format", "{{.Client.Version}} {{.Server.Version}}"],
                               capture_output=True, text=True, timeout=30)
        client, _, server = found.stdout.strip().partition(" ")
        return f"{self.runtime} {client or '?'}, server {server or '?'}, image {self.image}"

    def argv(self, program: Program, directory: str, limits: SandboxLimits, name: str) -> list[str]:
        """``runtime run`` for one program in container ``name``."""
        cpu = rlimit_argv(limits)[1].removeprefix("--cpu=")  # the launcher's rounding: "soft:hard"
        return [
            self.runtime, "run", "--interactive", "--pull", "never", "--name", name, "--init",
            "--network", "none", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--user", f"{NOBODY}:{NOBODY}", "--memory", str(limits.memory_bytes),
            "--memory-swap", str(limits.memory_bytes), "--cpu-shares", str(self.cpu_shares),
            "--pids-limit", str(limits.processes), "--ulimit", f"cpu={cpu}", "--ulimit", "core=0",
            "--tmpfs", f"/tmp:rw,nosuid,nodev,size={self.scratch_bytes}",
            "--volume", f"{directory}:/work:ro", "--workdir", "/work",
            "--env", "HOME=/tmp", "--env", "TMPDIR=/tmp", "--env", "PYTHONDONTWRITEBYTECODE=1",
            self.image, *program.argv,
        ]

    def watcher_argv(self, name: str) -> list[str]:
        """A process that removes container ``name`` when the runner's thread dies (its parent-death signal)."""
        runtime = shlex.quote(self.runtime_path)
        script = f'trap "{runtime} rm -f {name} >/dev/null 2>&1; exit 0" TERM; while :; do sleep 3600 & wait $!; done'
        return [self.setpriv, "--pdeathsig", "TERM", "--", "/bin/sh", "-c", script]

    def start(self, program, directory, limits):
        name = f"dew-sandbox-{uuid.uuid4().hex[:16]}"
        watcher = None
        if self.setpriv is not None:  # without util-linux the container outlives a killed parent
            watcher = subprocess.Popen(self.watcher_argv(name), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        try:
            process = subprocess.Popen(
                self.argv(program, directory, limits, name), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except BaseException:
            if watcher is not None:
                kill_group(watcher)
                watcher.wait()
            raise
        process.container, process.watcher = name, watcher

        def stop(exited: bool):
            # The CLI first: while it holds the container's output unread (an output flood), the daemon cannot finish
            # the container's attach stream, and a kill would wait on it.
            kill_group(process)
            if not exited:  # after a normal exit the container's init has ended everything inside it
                subprocess.run([self.runtime, "kill", name], capture_output=True, timeout=30)

        return process, stop

    def spent_cpu(self, process, usage, limits) -> bool:
        inspected = subprocess.run([self.runtime, "inspect", "--format", "{{.State.OOMKilled}}", process.container],
                                   capture_output=True, text=True, timeout=30)
        return inspected.returncode == 0 and inspected.stdout.strip() == "false"

    def release(self, process) -> None:
        subprocess.run([self.runtime, "rm", "--force", process.container], capture_output=True, timeout=60)
        if process.watcher is not None:
            kill_group(process.watcher)
            process.watcher.wait()
