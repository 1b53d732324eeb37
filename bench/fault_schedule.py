"""When a chaos run's next fault is due: on a seeded clock, or up to a chosen number after each update.

On a clock (``every`` seconds apart on average) the faults an update meets depend on how fast the machine trains:
a slower or busier machine gets more of them per update, so a run sized to pass its restart and retry budgets on
one machine can exhaust them on another. After each update (``per_update``, the tests' mode) the faults follow the
updates instead: once a driver has trained an update, up to ``per_update`` faults are injected, one at a time,
until it trains the next; so no update meets more than ``per_update`` of them on any machine. Faults that block
(a stall past a timeout lasts several seconds) can span updates: the updates they span get no faults of their
own, none are saved up for later. A fault that cannot be injected now (its actor is restarting, no second actor
of its role is listed) is tried again ``retry`` seconds later, within the same update.
"""

from __future__ import annotations

import random
import time


class FaultSchedule:
    """Says when to inject (:meth:`due`) from the updates trained so far; told what each try did (:meth:`tried`)."""

    def __init__(self, rng: random.Random, every: float | None = None, per_update: int | None = None,
                 retry: float = 1.0, clock=time.monotonic):
        if (every is None) == (per_update is None):
            raise ValueError(f"a fault schedule takes one of every (seconds) and per_update (faults after each "
                             f"update); got every={every!r}, per_update={per_update!r}")
        if every is not None and every <= 0:
            raise ValueError(f"every must be positive seconds; got {every!r}")
        if per_update is not None and per_update < 1:
            raise ValueError(f"per_update must be at least 1 fault after each update; got {per_update!r}")
        self.random, self.every, self.per_update, self.retry, self.clock = rng, every, per_update, retry, clock
        self.began = self.update = 0
        self.injected = 0  # faults injected since ``update`` was trained
        self.next = self.clock()

    def start(self, updates: int) -> None:
        """A driver begins with ``updates`` already trained: faults wait for its first update (its start, the
        actors' and the restore, is spared)."""
        self.began = self.update = updates
        self.injected = 0
        self.next = self.clock() + (self.random.uniform(0.5, 2) * self.every if self.every is not None else 0.0)

    def due(self, updates: int) -> bool:
        """Whether to inject a fault now, ``updates`` updates having been trained."""
        if updates <= self.began:
            return False
        if self.per_update is not None and updates != self.update:  # a new update: its own faults, none saved up
            self.update, self.injected, self.next = updates, 0, self.clock()
        if self.clock() < self.next:
            return False
        return self.every is not None or self.injected < self.per_update

    def tried(self, injected: bool) -> None:
        """The fault :meth:`due` called for was injected (or could not be now)."""
        if self.every is not None:
            self.next = self.clock() + self.random.uniform(0.5, 1.5) * self.every
        elif injected:
            self.injected += 1
        else:
            self.next = self.clock() + self.retry

    def poll(self, updates: int, inject, scripted: list[str]) -> None:
        """One fault through ``inject(kind)`` if one is due: the first of ``scripted`` (taken off once injected), or
        a seeded one (kind None); ``inject`` returns None when the fault could not be injected now."""
        if self.due(updates):
            injected = inject(scripted[0] if scripted else None)
            if injected is not None and scripted:
                scripted.pop(0)
            self.tried(injected is not None)
