"""The read-ahead streams ``RolloutScheduler.tasks(dataset)`` wraps a training stream in.

The Trainer does not prefetch: it reads batch i, then steps on it. The wrapper reads up
to ``ahead`` batches beyond the one it hands over and registers each with the scheduler
as it reads it, so the scheduler can submit them early. Over a stream with positions
(:class:`~dew.data.dataset.StreamPosition`) it reports the position of the next batch it
will hand over, not of the next it will read, so the checkpointed data position stays the
trainer's; restoring a position drops what was read ahead and resets the scheduler. The
position also carries the scheduler's group numbering (``{"stream": ..., "group": ...}``), so
a resumed run numbers its groups, and seeds its samples, as the uninterrupted run did.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, Protocol

from dew.data.dataset import Batch


class Registry(Protocol):
    """What a stream tells about the batches it reads (the scheduler)."""

    ahead: int
    next_group: int

    def register(self, batch: Batch) -> None: ...

    def reset(self) -> None: ...


class AheadStream:
    """Reads up to ``ahead`` batches beyond the one it hands over, registering each as it reads it."""

    def __init__(self, scheduler: Registry, inner: Iterator[Batch]):
        self._scheduler, self._inner = scheduler, inner
        self._buffer: collections.deque = collections.deque()  # ((position, first group) before the batch, batch)
        self._ended = False

    def __iter__(self):
        return self

    def _where(self) -> Any:
        return None, self._scheduler.next_group

    def _fill(self) -> None:
        while not self._ended and len(self._buffer) < self._scheduler.ahead + 1:
            where = self._where()
            try:
                batch = next(self._inner)
            except StopIteration:
                self._ended = True
                return
            self._scheduler.register(batch)
            self._buffer.append((where, batch))

    def __next__(self) -> Batch:
        self._fill()
        if not self._buffer:
            raise StopIteration
        return self._buffer.popleft()[1]


class PositionedStream(AheadStream):
    """An ahead stream over a stream with positions: reports the next batch it hands over."""

    def _where(self) -> Any:
        return self._inner.position(), self._scheduler.next_group

    def position(self) -> Any:
        inner, group = self._buffer[0][0] if self._buffer else self._where()
        return {"stream": inner, "group": group}

    def restore(self, position: Any) -> None:
        if isinstance(position, dict) and set(position) == {"stream", "group"}:
            inner, group = position["stream"], int(position["group"])
        else:  # a checkpoint from before the position carried the group numbering
            inner, group = position, self._scheduler.next_group
        self._inner.restore(inner)
        self._buffer.clear()
        self._ended = False
        self._scheduler.reset()
        self._scheduler.next_group = group
