"""Datasets the Trainer reads, and the protocol by which a stream reports its position.

A :class:`Dataset` holds callables rather than data: ``train(partition)`` returns an
iterator of fixed-shape numpy batches holding this process's share of each global
batch, and ``val(partition)``, when given, returns a finite iterable of batches for
validation. ``records`` is the number of records in the training data when known and
``batch`` the global batch size in rows.

A stream that can say where it is implements :class:`StreamPosition`; the trainer's
checkpoints store that position and hand it back on resume. A stream that does not
is resumed by skipping the number of batches already consumed, which is exact for
deterministic streams such as ``itertools.repeat``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which share of the data a process reads: process ``index`` of ``count``."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"partition index must lie in [0, count), got index={self.index}, count={self.count}")


def local_partition() -> Partition:
    """This process's partition of the data: its process index among all JAX processes."""
    import jax  # here, not at the top: a loader's worker process imports this module and never needs JAX

    return Partition(index=jax.process_index(), count=jax.process_count())


@runtime_checkable
class StreamPosition(Protocol):
    """A training stream that reports and restores its position.

    ``position()`` returns a JSON-serialisable value describing the next batch the
    stream will yield; ``restore(position)`` makes a fresh stream continue from there.
    """

    def position(self) -> Any: ...

    def restore(self, position: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Training data for the Trainer: stream factories plus their sizes."""

    train: Callable[[Partition], Iterator[Batch]]
    val: Callable[[Partition], Iterable[Batch]] | None = None
    records: int | None = None
    batch: int | None = None

    def __post_init__(self):
        if not callable(self.train):
            raise TypeError(f"Dataset.train must be a callable taking a partition, got {type(self.train).__name__}")
        if self.val is not None and not callable(self.val):
            raise TypeError(f"Dataset.val must be None or a callable taking a partition, got {type(self.val).__name__}")
        if self.batch is not None and (not isinstance(self.batch, int) or self.batch < 1):
            raise ValueError(f"Dataset.batch must be a positive integer, got {self.batch!r}")
        if self.records is not None and (not isinstance(self.records, int) or self.records < 0):
            raise ValueError(f"Dataset.records must be a non-negative integer or None, got {self.records!r}")


class TrainStream:
    """The trainer's view of a training stream: counts batches and restores positions."""

    def __init__(self, dataset: Dataset, partition: Partition):
        self._iterator = iter(dataset.train(partition))
        self.consumed = 0

    def position(self) -> dict:
        inner = self._iterator.position() if isinstance(self._iterator, StreamPosition) else None
        return {"consumed": self.consumed, "stream": inner}

    def restore(self, position: dict) -> None:
        consumed = int(position["consumed"])
        if isinstance(self._iterator, StreamPosition) and position.get("stream") is not None:
            self._iterator.restore(position["stream"])
        else:
            skipped = sum(1 for _ in itertools.islice(self._iterator, consumed))
            if skipped != consumed:
                raise ValueError(
                    f"cannot restore the data position: the training stream ended after {skipped} batches, "
                    f"but the checkpoint had consumed {consumed}"
                )
        self.consumed = consumed

    def __next__(self) -> Batch:
        try:
            batch = next(self._iterator)
        except StopIteration:
            # A StopIteration escaping fit() could silently end a caller's loop; say it plainly instead.
            raise RuntimeError(
                f"the training stream ended after {self.consumed} batches, before fit reached its step count"
            ) from None
        self.consumed += 1
        return batch
