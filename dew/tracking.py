"""Where training metrics go: a console progress bar with log lines, and a JSONL file.

The console shows a tqdm bar (steps/s and ETA) on standard error and prints one line
per logged step with the rate and ETA on standard output, so logs captured by a job
runner without the bar still say how fast training goes.
With an output directory every logged record is also appended to
``<output_dir>/metrics.jsonl`` and goes to the run's experiment trackers (TensorBoard,
W&B: :mod:`dew.experiment_trackers`) as ``<kind>/<name>``; without one nothing is
written to disk. Only the first process of a multi-process job reports.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from dew.experiment_trackers import ExperimentTracker, MetricWriters


def format_metrics(metrics: dict[str, float]) -> str:
    parts = []
    for name, value in metrics.items():
        if isinstance(value, float):
            parts.append(f"{name} {value:.4g}" if math.isfinite(value) else f"{name} {value}")
        else:
            parts.append(f"{name} {value}")
    return " | ".join(parts)


class Tracker:
    """Progress bar plus metric records for one ``fit`` call."""

    def __init__(self, total: int, start: int, output_dir: str | Path | None, enabled: bool, progress: bool,
                 trackers: tuple[ExperimentTracker, ...] = ()):
        self.enabled = enabled
        self._file = None
        self._bar = None
        self._writers = None
        self._start_time = time.perf_counter()
        self._start_step = start
        self._total = total
        if not enabled:
            return
        if output_dir is not None:
            path = Path(output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a")
            self._writers = MetricWriters(trackers, output_dir, start_step=start)
        if progress:
            # Redraw less often where the bar goes to a log file rather than a terminal.
            interval = 0.1 if sys.stderr.isatty() else 2.0
            self._bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr, leave=False,
                mininterval=interval,
            )

    def advance(self, loss: float | None = None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, **metrics}
        if kind == "train":
            elapsed = time.perf_counter() - self._start_time
            rate = (step - self._start_step) / elapsed if elapsed > 0 else float("nan")
            record["steps_per_second"] = rate
            record["eta_seconds"] = (self._total - step) / rate if rate > 0 else float("nan")
        line = f"[{kind}] step {step} | " + format_metrics({k: v for k, v in record.items() if k not in ("kind", "step")})
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writers is not None:
            self._writers.write(step, {k: v for k, v in record.items() if k not in ("kind", "step")}, f"{kind}/")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._writers is not None:
            self._writers.close()
