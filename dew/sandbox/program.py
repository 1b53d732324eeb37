"""What a sandbox runs and what comes back: ``Program``, ``SandboxLimits``, ``Verdict``, ``Outcome``."""

from __future__ import annotations

import dataclasses
import enum
from dew.validation import positive, positive_int
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Program:
    """Files written into a fresh temporary directory, an argv run there without a shell, and its stdin.

    files: relative path -> text or bytes (no absolute paths, no ``..``).
    argv: the command and its arguments; ``argv[0]`` is looked up on the sandbox's PATH.
    """

    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    argv: Sequence[str] = ()
    stdin: str | bytes = b""

    def __post_init__(self):
        if isinstance(self.argv, (str, bytes)) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"argv must be a non-empty sequence of strings (no shell), got {self.argv!r}")
        for name, content in self.files.items():
            parts = str(name).replace("\\", "/").split("/")
            if not name or str(name).startswith("/") or ".." in parts:
                raise ValueError(f"file names must be relative paths inside the job directory, got {name!r}")
            if not isinstance(content, (str, bytes)):
                raise TypeError(f"file {name!r} must hold str or bytes, got {type(content).__name__}")
        if not isinstance(self.stdin, (str, bytes)):
            raise TypeError(f"stdin must be str or bytes, got {type(self.stdin).__name__}")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed process tree.

    cpu_seconds: RLIMIT_CPU (the kernel kills the process when it is spent).
    memory_bytes: RLIMIT_AS, the address space of each process.
    wall_seconds: the wall-clock deadline; the process group is killed when it passes.
    output_bytes: stdout plus stderr captured before the program is killed as OUTPUT_LIMIT.
    processes: RLIMIT_NPROC, processes the sandbox user may hold (not enforced for root;
    the bubblewrap runner runs programs as an unprivileged user for that reason).
    message_bytes: the largest JSON-lines message SubprocessEnvironment accepts from a worker.
    """

    cpu_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    wall_seconds: float = 30.0
    output_bytes: int = 1 << 20
    processes: int = 64
    message_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("cpu_seconds", "wall_seconds"):
            value = getattr(self, name)
            positive(f"SandboxLimits.{name}", value)
        for name in ("memory_bytes", "output_bytes", "processes", "message_bytes"):
            value = getattr(self, name)
            positive_int(f"SandboxLimits.{name}", value)


class Verdict(enum.Enum):
    """How a program ended."""

    COMPLETED = "completed"  # exit status 0
    FAILED = "failed"  # a non-zero exit status
    TIMEOUT = "timeout"  # the wall-clock or CPU-time deadline passed
    CRASHED = "crashed"  # killed by a signal (the memory limit included)
    OUTPUT_LIMIT = "output_limit"  # wrote more than output_bytes


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a program did: its verdict, exit code (negative: the signal), output (UTF-8, bad bytes replaced) and seconds."""

    verdict: Verdict
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
