"""Start a process with dew's sandbox limits: the launcher ProcessRunner and SubprocessEnvironment share.

``launch(argv, cwd, limits)`` starts ``argv`` in ``cwd`` as the leader of a new session
(so its whole process group can be killed), with RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC and
no core dumps set by ``prlimit`` and SIGKILL on the parent's death set by ``setpriv
--pdeathsig`` (util-linux), each of which sets its part and execs the next: no Python
code runs in the child between fork and exec, which is what makes this safe in a
threaded parent. The environment is minimal (PATH, LANG, HOME=cwd) plus ``env``; none
of the parent's variables, secrets included, reach the program.

It keeps the caller's user, filesystem and network: trusted code only. Untrusted code
needs the bubblewrap or container runner around it.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

from dew.sandbox.program import SandboxLimits

BASE_ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _tool(name: str) -> str:
    path = shutil.which(name, path=BASE_ENVIRONMENT["PATH"])
    if path is None:
        raise RuntimeError(f"the sandbox launcher needs util-linux's {name!r} (apt-get install util-linux)")
    return path


def rlimit_argv(limits: SandboxLimits) -> list[str]:
    """``prlimit`` setting RLIMIT_CPU (SIGXCPU at the limit, SIGKILL a second later), RLIMIT_AS, RLIMIT_NPROC, no core."""
    cpu = max(1, math.ceil(limits.cpu_seconds))
    return [
        _tool("prlimit"), f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_bytes}", "--core=0",
        f"--nproc={limits.processes}", "--",
    ]


def limit_argv(limits: SandboxLimits) -> list[str]:
    """The wrapper commands that apply ``limits`` and then exec the program."""
    return [_tool("setpriv"), "--pdeathsig", "KILL", "--", *rlimit_argv(limits)]


def minimal_environment(cwd: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**BASE_ENVIRONMENT, "HOME": str(cwd), "TMPDIR": str(cwd), **(env or {})}


def launch(
    argv: Sequence[str],
    cwd: str,
    limits: SandboxLimits,
    env: Mapping[str, str] | None = None,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
) -> subprocess.Popen:
    """Start ``argv`` under ``limits`` in its own session (see the module docstring)."""
    return subprocess.Popen(
        [*limit_argv(limits), *argv], cwd=cwd, env=minimal_environment(cwd, env), stdin=stdin, stdout=stdout,
        stderr=stderr, start_new_session=True, close_fds=True,
    )


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group (it leads its own session); already gone is fine."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
