"""Local processes read from /proc, for the benches and tests that start Ray heads and engines and must end them.

A Ray head started with ``ray start --temp-dir=D`` names D in the command lines of its GCS,
raylet and dashboard processes, but the agents the raylet spawns (DashboardAgent,
RuntimeEnvAgent) and its workers rename their process titles: they are found as
descendants of the processes that name D, before the first signal reparents them; the
Ray client server ``ray start`` also starts names neither D nor a parent of the head (it
is found by the head's GCS port in its ``--address``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def process_table() -> dict[int, tuple[str, int, int]]:
    """Every live process: pid -> (state, parent pid, process group)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            table[int(entry.name)] = (fields[0], int(fields[1]), int(fields[2]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(pid: int, table: dict | None = None) -> list[int]:
    """Every live descendant of ``pid``, oldest first."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return sorted(found)


def group_processes(group: int) -> list[int]:
    """Live processes of process group ``group`` (zombies aside)."""
    return sorted(pid for pid, (state, _, pgrp) in process_table().items() if pgrp == group and state != "Z")


def signal_process(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False when it is gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def naming(text: str) -> list[int]:
    """Processes (other than this one) whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def stop_ray_head(temp_dir: str, port: int | None = None, grace: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` s, every process of the Ray head whose temporary directory is
    ``temp_dir`` and every descendant of them, and with the head's GCS ``port`` its Ray client server (see the
    module docstring); returns the pids signalled."""
    table = process_table()
    head = set(naming(temp_dir))
    if port is not None:
        head.update(set(naming("ray.util.client.server")) & set(naming(f":{port}\x00")))
    for pid in list(head):
        head.update(descendants(pid, table))
    head.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in sorted(head | set(naming(temp_dir))):
            signal_process(pid, sig)
        time.sleep(grace)
    return sorted(head)
