"""What an RLVR run's driver writes as it trains: ``metrics.jsonl``, ``held_out.jsonl``, the verl rows and the trackers.

One metrics row per update (:func:`update_row` folds every trainer process's report into it),
one held-out point per measurement, and with ``verl_rows`` each update's admitted rollouts in
``verl_rows/update-<step>.jsonl``. A run that resumes from a checkpoint at update S keeps what
S holds and drops the rest (:meth:`RunRecord.resume`): those updates are trained again and
write their lines again, so every update has exactly one row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dew.experiment_trackers import MetricWriters

VERL_ROWS = "verl_rows"  # the run directory's folder of verl AgentLoopOutput rows (config verl_rows)
HELD_OUT = "held_out.jsonl"  # the run directory's held-out reward curve, one {"step", "reward"} line per point
METRICS = "metrics.jsonl"  # one line per update


class RunRecord:
    """The run directory's metrics rows and held-out curve, kept in memory too (``rows``, ``curve``)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.rows: list[dict] = []  # the updates' rows, each once its checkpoint (if it was due) holds it
        self.curve: list[dict] = []  # {"step", "reward"} per held-out measurement, step 0 the warm start
        self.writers: MetricWriters | None = None

    def resume(self, step: int, reward_before: dict[str, float], writers: MetricWriters) -> None:
        """Keep the rows, verl rows and held-out points of the updates the restored checkpoint holds (update
        ``step``); a fresh run's curve starts with the warm start's point, which goes to ``writers`` too."""
        self.writers = writers
        self.rows = _keep_lines(self.run_dir / METRICS, lambda row: row["step"] <= step)
        for written in (self.run_dir / VERL_ROWS).glob("update-*.jsonl"):
            if int(written.stem.split("-")[1]) > step:
                written.unlink()
        self.curve = _keep_lines(self.run_dir / HELD_OUT, lambda point: point["step"] <= step)
        if not self.curve:
            self.held_out(0, reward_before)

    def held_out(self, step: int, reward: dict[str, float]) -> None:
        """A held-out measurement after update ``step``."""
        self.curve.append({"step": step, "reward": reward})
        with open(self.run_dir / HELD_OUT, "a") as file:
            file.write(json.dumps(self.curve[-1]) + "\n")
        if self.writers is not None:
            self.writers.write(step, {"held_out": reward})

    def write(self, row: dict, verl_rows: list[dict] | None) -> None:
        """An update's row to ``metrics.jsonl`` and the trackers, and its verl rows (None: not asked for).

        It is written before the update's checkpoint: a crash between the two retrains the update and rewrites its
        row, where the other order would leave a trained update without one. ``rows`` takes it at :meth:`keep`.
        """
        with open(self.run_dir / METRICS, "a") as file:
            file.write(json.dumps(row) + "\n")
        self.writers.write(row["step"], {k: v for k, v in row.items() if k != "step"})
        if verl_rows is not None:
            directory = self.run_dir / VERL_ROWS
            directory.mkdir(exist_ok=True)
            path = directory / f"update-{row['step']:06d}.jsonl"
            partial = path.with_suffix(".partial")
            partial.write_text("".join(json.dumps(verl) + "\n" for verl in verl_rows))
            os.replace(partial, path)  # a retrained update rewrites its file whole

    def keep(self, row: dict) -> None:
        self.rows.append(row)

    def wait_share(self) -> float | None:
        """The share of wall time after the first update that the trainer spent waiting for rollouts."""
        later = self.rows[1:]
        wall = sum(row["wall"] for row in later)
        return sum(row["waited"] or 0.0 for row in later) / wall if wall > 0 else None

    def close(self) -> None:
        if self.writers is not None:
            self.writers.close()
            self.writers = None


def update_row(results: list, wall: float, servers: int) -> tuple[dict, list[dict], dict]:
    """One update's metrics row from every trainer process's ``step`` result, with its verl rows and process 0's
    scheduler record: the trainer's metrics (``train/``), the scheduler's (``scheduler/``, ``rollout/``), the tasks
    and verdicts of every process's share of the batch, ``wall`` seconds and the rollout servers serving."""
    reports = [process_metrics.pop("report", {}) for (process_metrics,) in results]
    verl_rows = [row for theirs in reports for row in theirs.pop("verl_rows", [])]
    (metrics,) = results[0]
    scheduler = reports[0].get("scheduler", {})  # process 0's record; each process keeps its own
    tasks, verdicts = [], {}
    for theirs in reports:
        tasks += theirs.get("tasks", [])
        for verdict, seen in theirs.get("verdicts", {}).items():
            verdicts[verdict] = verdicts.get(verdict, 0) + seen
    row = {"step": metrics["step"], "updates": metrics["updates"], "wall": wall,
           "waited": scheduler.pop("waited", None), "tasks": tasks, "verdicts": verdicts,
           **{f"train/{k}": v for k, v in metrics.items() if k not in ("step", "updates")},
           **{k if k.startswith("rollout/") else f"scheduler/{k}": v for k, v in scheduler.items()},
           "fleet/servers": servers}
    return row, verl_rows, scheduler


def _keep_lines(path: Path, keep) -> list[dict]:
    """The JSON lines of ``path`` (none if absent) for which ``keep`` holds; the file is rewritten with those alone."""
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    kept = [line for line in lines if keep(line)]
    path.write_text("".join(json.dumps(line) + "\n" for line in kept))
    return kept
