"""Ray's token authentication for the clusters dew-ray's tools start with ``ray start``.

With ``RAY_AUTH_MODE=token`` (Ray 2.52 and later) every RPC and HTTP entry point of a cluster
(GCS, raylets, dashboard, job submission) asks for one shared token, read from
``RAY_AUTH_TOKEN``, from the file ``RAY_AUTH_TOKEN_PATH`` names, or from ``~/.ray/auth_token``.
A cluster's raylets and GCS listen on every interface even when started for one machine, so a
cluster without it runs code for anyone who reaches the machine. ``ray.init()`` turns it on by
itself for the local cluster it starts (and makes the token); ``ray start`` does not, and
refuses token mode without a token. :func:`token_auth` is what a script does before it starts
raylets: the mode in this process's environment (inherited by everything it starts) and a
token made with Ray's own ``ray get-auth-token --generate`` when none is set or saved.

Ray reads the mode when it is imported: call :func:`token_auth` before ``import ray``. This
module imports nothing of Ray for that reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TOKEN_FILE = Path.home() / ".ray" / "auth_token"  # Ray's default token path


def has_token() -> bool:
    """Whether Ray finds a token: ``RAY_AUTH_TOKEN``, the ``RAY_AUTH_TOKEN_PATH`` file or ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:  # Ray reads this file and no other once it is named
        return Path(path).is_file()
    return TOKEN_FILE.is_file() and TOKEN_FILE.stat().st_size > 0


def token_auth() -> None:
    """``RAY_AUTH_MODE=token`` for this process and its children (unless the mode is already set), and a token."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"].lower() != "token" or has_token():
        return
    ray = Path(sys.executable).parent / "ray"
    made = subprocess.run([str(ray), "get-auth-token", "--generate"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    if made.returncode != 0 or not has_token():
        raise RuntimeError(f"`ray get-auth-token --generate` did not make Ray's token ({TOKEN_FILE}): "
                           f"{made.stderr.strip()[-500:]}")
    TOKEN_FILE.chmod(0o600)  # Ray writes it with the umask's mode (often world-readable): the token is a password
