"""Calls an async actor runs under its caller's key, cancellable even before they arrive.

A client names each call with a key (a uuid) and may cancel it at any time. Ray does not
order an actor's calls, so ``cancel(key)`` can reach the actor before the call it cancels:
the key is remembered, and the call, when it comes, returns its cancelled result at once
instead of starting. Remembered keys are bounded (the oldest are forgotten first): a cancel
that comes for a call that already finished is remembered too, and would otherwise stay
for the actor's life.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

REMEMBERED = 65_536  # cancels held for calls not yet arrived (or long finished); about 10 MB of keys at most


class KeyedCalls:
    """The calls in flight by key, and the keys cancelled before their call arrived (see the module docstring).

    ``cancel_future(future)`` stops a started call (its future then resolves as cancelled).
    """

    def __init__(self, cancel_future: Callable[[Future], None], remembered: int = REMEMBERED):
        self._cancel_future = cancel_future
        self._remembered = remembered
        self._running: dict[str, Future] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    async def run(self, key: str, start: Callable[[], Future], cancelled: Callable[[], Any]) -> Any:
        """``start()``'s future's result, awaited in the actor's event loop; ``cancelled()`` when ``key`` was
        cancelled before this call arrived."""
        if key in self._cancelled:
            del self._cancelled[key]
            return cancelled()
        future = start()
        self._running[key] = future
        try:
            return await asyncio.wrap_future(future)
        finally:
            self._running.pop(key, None)

    def cancel(self, key: str) -> None:
        future = self._running.get(key)
        if future is not None:
            self._cancel_future(future)
            return
        self._cancelled[key] = None
        while len(self._cancelled) > self._remembered:
            self._cancelled.popitem(last=False)

    def __len__(self) -> int:
        """Calls running now."""
        return len(self._running)
