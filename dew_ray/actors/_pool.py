"""Choosing the actor that takes the next piece of work, for the clients of actor pools."""

from __future__ import annotations

import threading


class LeastBusy:
    """The live actor with the fewest pieces of work in flight takes the next one; dead ones are left out."""

    def __init__(self, count: int, what: str):
        self.count, self.what = count, what
        self.in_flight = [0] * count
        self.dead: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        """The index of the actor that takes the next piece; raises when every actor has died."""
        with self._lock:
            live = [i for i in range(self.count) if i not in self.dead]
            if not live:
                raise RuntimeError(f"every {self.what} has died ({self.count} started)")
            index = min(live, key=lambda i: self.in_flight[i])
            self.in_flight[index] += 1
            return index

    def release(self, index: int, died: bool = False) -> None:
        """A piece of actor ``index`` finished; ``died``: the actor is gone and takes no more."""
        with self._lock:
            self.in_flight[index] -= 1
            if died:
                self.dead.add(index)

    @property
    def live(self) -> int:
        return self.count - len(self.dead)
