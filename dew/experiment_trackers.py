"""Experiment trackers: TensorBoard event files and Weights & Biases runs, beside ``metrics.jsonl``.

A tracker is a small picklable setting (it travels to Ray actors and sits in configs);
``open(directory, start_step, config)`` makes the writer that receives every logged
record. ``Trainer(..., trackers=["tensorboard", "wandb"])`` and the pipelines' ``trackers``
option name them; an instance sets more (a W&B project, an online run):

    Trainer(objective, optimizer, key=key, output_dir="runs/sft",
            trackers=[TensorBoard(), WandB(project="my-sft", mode="online")])

TensorBoard: tensorboardX writes the event files (no torch or TensorFlow needed) to
``<directory>/tensorboard``; ``tensorboard --logdir <directory>`` shows them. A run that
resumes from a checkpoint at step S purges the events after S, since those updates
are trained again.

W&B: ``mode="offline"`` (the default) writes the run under ``<directory>/wandb`` and sends
nothing (``wandb sync <directory>/wandb/offline-run-*`` uploads it later); ``"online"``
needs ``wandb login``. The run id is kept in ``<directory>/wandb-run-id`` so a resumed run
continues the same W&B run; W&B keeps the first value it saw for a step, so a retrained
update's new values show from the first step past the old run's last. An offline run's
``run-<id>.wandb`` file is complete once the process ends: W&B's service writes it in blocks
and closes it after the run finishes, so a program that reads it itself calls
``wandb.teardown()`` first. The ``wandb``
package is an optional extra: ``pip install 'dew-ray[wandb]'``.

Every numeric value is logged (a bool as 0/1); a mapping of numbers is logged under
``name/key``; strings, lists and None are left to ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field
from tensorboardX import SummaryWriter

from dew.config import Config

TRACKER_NAMES = ("tensorboard", "wandb")


class MetricWriter(Protocol):
    """An open tracker: receives records of flat scalar names, then is closed once."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The loggable numbers of a metrics record: numbers (bools as 0/1) and mappings of them, flattened."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{key}/"))
        elif not isinstance(value, (str, bytes)) and hasattr(value, "__float__"):  # numbers, numpy scalars
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                continue
    return out


@dataclasses.dataclass(frozen=True)
class TensorBoard:
    """TensorBoard event files under ``logdir`` (default ``<directory>/tensorboard``)."""

    logdir: str | None = None

    def open(self, directory: Path, start_step: int, config: Mapping[str, Any] | None = None) -> MetricWriter:
        logdir = Path(self.logdir) if self.logdir is not None else Path(directory) / "tensorboard"
        logdir.mkdir(parents=True, exist_ok=True)
        # purge_step hides the events of steps after the checkpoint this run resumed from: they are trained again
        # tensorboardX names the file by the second and host alone and opens it for writing from scratch: a run
        # resumed within the same second would erase the last one's events. The suffix keeps each file apart and,
        # being the time in nanoseconds at a fixed width, keeps the name order (TensorBoard's reading order) the
        # order the runs wrote in.
        writer = SummaryWriter(str(logdir), purge_step=start_step + 1 if start_step > 0 else None, flush_secs=10,
                               filename_suffix=f".{time.time_ns():020d}.{os.getpid()}")
        return _TensorBoardWriter(writer)


class _TensorBoardWriter:
    def __init__(self, writer: SummaryWriter):
        self._writer = writer

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            if math.isfinite(value):  # TensorBoard draws NaN and inf as gaps anyway; the JSONL file keeps them
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@dataclasses.dataclass(frozen=True)
class WandB:
    """A Weights & Biases run under ``<directory>/wandb`` (see the module docstring for the modes)."""

    project: str = "dew-ray"
    mode: Literal["offline", "online", "disabled"] = "offline"
    name: str | None = None
    entity: str | None = None
    group: str | None = None

    def __post_init__(self):
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"WandB mode must be 'offline', 'online' or 'disabled', got {self.mode!r}")

    def open(self, directory: Path, start_step: int, config: Mapping[str, Any] | None = None) -> MetricWriter:
        try:
            import wandb  # an optional extra: only a run that asks for W&B needs it installed
        except ImportError:
            raise ImportError("the 'wandb' tracker needs the wandb package: pip install 'dew-ray[wandb]'") from None
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        run = wandb.init(
            project=self.project, entity=self.entity, name=self.name, group=self.group, mode=self.mode,
            dir=str(directory), id=run_id, resume="allow", config=dict(config or {}), reinit="create_new",
            # console capture would wrap the process's stdout, which the progress bar and Ray's log capture own
            settings=wandb.Settings(console="off", silent=True),
        )
        return _WandBWriter(run)


class _WandBWriter:
    def __init__(self, run):
        self._run = run

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


ExperimentTracker = TensorBoard | WandB


def tracker_of(tracker: str | ExperimentTracker, wandb: WandB | None = None) -> ExperimentTracker:
    """A tracker from its name ("tensorboard", "wandb": ``wandb``'s settings, default WandB()) or itself."""
    if isinstance(tracker, (TensorBoard, WandB)):
        return tracker
    if tracker == "tensorboard":
        return TensorBoard()
    if tracker == "wandb":
        return wandb or WandB()
    raise ValueError(f"unknown tracker {tracker!r}: expected one of {list(TRACKER_NAMES)}, a TensorBoard or a WandB")


def trackers_of(trackers: Iterable[str | ExperimentTracker]) -> tuple[ExperimentTracker, ...]:
    """Trackers from a list of names and instances; a lone name or instance is refused (say it as a list)."""
    if isinstance(trackers, (str, TensorBoard, WandB)):
        raise TypeError(f"trackers must be a list of trackers, got the single {trackers!r}: write [{trackers!r}]")
    return tuple(tracker_of(tracker) for tracker in trackers)


class TrackerOptions(Config):
    """The trackers of a pipeline's config (mixed into it): ``trackers = ["tensorboard", "wandb"]``; the W&B run
    goes to ``wandb_project`` in ``wandb_mode`` ("offline" writes the run directory only)."""

    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    wandb_project: str = "dew-ray"
    wandb_mode: Literal["offline", "online"] = "offline"

    def experiment_trackers(self, name: str | None = None, group: str | None = None) -> tuple[ExperimentTracker, ...]:
        """The configured trackers; ``name`` and ``group`` label the W&B run."""
        wandb = WandB(project=self.wandb_project, mode=self.wandb_mode, name=name, group=group)
        return tuple(tracker_of(tracker, wandb) for tracker in dict.fromkeys(self.trackers))


class MetricWriters:
    """The open writers of a run's trackers; a record goes to each of them."""

    def __init__(self, trackers: Iterable[ExperimentTracker], directory: str | Path, start_step: int = 0,
                 config: Mapping[str, Any] | None = None):
        self._writers: list[MetricWriter] = []
        try:
            for tracker in trackers:
                self._writers.append(tracker.open(Path(directory), start_step, config))
        except BaseException:
            self.close()
            raise

    def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
        numbers = scalars(metrics, prefix)
        for writer in self._writers:
            writer.write(step, numbers)

    def close(self) -> None:
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()
