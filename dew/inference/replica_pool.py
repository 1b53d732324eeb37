"""Replicas that share work: the least busy live replica takes the next piece; the silent are set aside.

Every pool of replicas in dew-ray is a :class:`ReplicaPool`: :class:`~dew.inference.EnginePool`
(vLLM or SGLang engines behind one publisher) and, in the Ray layer, ``ServerPool`` (rollout
server actors), ``RemoteEnvironmentSource`` (environment workers) and ``RemoteFleet``
(sandbox runners). Each says what a replica is (a name, and how to ask it whether it lives);
the pool does the rest, the same way for all of them:

- **choice by load**: :meth:`~ReplicaPool.take` gives the live replica with the fewest pieces in
  flight a :class:`Ticket`; :meth:`~ReplicaPool.release` ends it, whatever the outcome. When no
  replica is live but some are set aside, ``take`` waits up to ``wait`` seconds (default
  ``timeout``) for one to come back, then raises naming how many died and how many stopped
  answering.
- **liveness**: a replica is dead for good when a piece ends with ``died=True``, when its own
  word says so (``died(index)``, read at every choice, so a replica that fails at once is never
  the least busy one for long), or when ``probe`` raises
  :class:`~dew.inference.rollout_server.ServerDied`. A replica whose host starts it again (a
  vLLM engine under a restarting actor) says so with ``away(index)`` instead, also read at every
  choice: it is set aside, not given up, and its probe finds it where it comes back. A piece
  that fails for another reason makes the pool probe its replica, on a thread of its own, never
  under a lock others need: a replica slow to answer delays only its own check.
- **set-aside**: with a ``timeout``, a replica with pieces in flight that answers nothing for
  ``timeout`` seconds is probed, and if the probe goes unanswered for ``timeout`` seconds too,
  it is set aside: each of its pieces is abandoned (the function given with
  :meth:`~ReplicaPool.attach` stops it and fails it with ``ServerDied``, so callers run it
  again on the others), no piece goes to it, and ``on_aside(index)`` tells the publisher to
  leave it out of weight loads. :meth:`~ReplicaPool.set_aside` does the same for a silence found
  elsewhere (a load it did not answer).
- **membership**: :meth:`~ReplicaPool.add` brings a new replica in set aside, so it takes no
  piece before its first probe answers and ``rejoin`` has brought it to the newest weights;
  :meth:`~ReplicaPool.retire` takes one out for good: no new piece goes to it, its pieces in
  flight finish (or, past a timeout, are abandoned and run again elsewhere), and it is never
  probed again.
- **rejoin**: a replica set aside is probed until it answers; then ``rejoin(index, served)``
  (``served``: what the probe answered, the version it serves where it knows one) brings it to
  the newest weights and says whether it serves them. On True it takes pieces again; on False
  it stays aside and is probed again after ``timeout`` seconds.

The pool holds no replica objects: ``probe``, ``rejoin``, ``on_aside`` and ``died`` are the
owner's functions of a replica's index, so the Ray layer adds only what Ray needs (actor
handles and its death errors) and the HTTP engines only theirs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from dew.inference.rollout_server import DrawFuture, RolloutServer, ServerDied, settle
from dew.validation import distinct, positive

logger = logging.getLogger(__name__)

CHECK_TIMEOUT = 30.0  # seconds a failed piece's liveness check waits for its replica's answer
PROBE_PAUSE = 0.5  # the least seconds between two probes of a replica set aside (one that says "not now" at once)


@dataclasses.dataclass(eq=False)
class Ticket:
    """One piece of work on replica ``replica``, from ``take`` to ``release`` (or abandonment)."""

    replica: int
    sent: float
    abandon: Callable[[BaseException], bool | None] | None = None  # False: the piece had ended on its own first
    abandoned: BaseException | None = None
    ended: bool = False


class ReplicaPool:
    """Work spread over named replicas (see the module docstring).

    names: one distinct name per replica (messages use them); what, work: how messages call a
    replica and its pieces ("rollout server", "draws"); timeout: seconds of silence before a
    replica is probed and set aside (None: never); probe(index, timeout): what the replica
    serves, None when it answered nothing within ``timeout``, ServerDied when it is gone;
    rejoin(index, served) -> bool; on_aside(index); died(index) -> bool (gone for good); away(index) -> bool
    (gone from where it was, coming back: set aside); wait: seconds ``take`` waits for a replica set aside to
    come back when none is live (None: ``timeout``).
    """

    def __init__(self, names: Sequence[str], *, what: str = "replica", work: str = "pieces",
                 timeout: float | None = None, probe: Callable[[int, float], object] | None = None,
                 rejoin: Callable[[int, object], bool] | None = None, on_aside: Callable[[int], None] | None = None,
                 died: Callable[[int], bool] | None = None, away: Callable[[int], bool] | None = None,
                 wait: float | None = None):
        self.names = [str(name) for name in names]
        if not self.names:
            raise ValueError(f"a pool of {what}s needs at least one")
        distinct(f"the names of the pool's {what}s", self.names, why="messages and publishers find them by name")
        if timeout is not None:
            positive("timeout", timeout, why="seconds, or None")
            if probe is None:
                raise ValueError(f"a timeout sets silent {what}s aside, which needs a probe to find them answering")
        if away is not None and probe is None:
            raise ValueError(f"{what}s that come back (away) are set aside, which needs a probe to find them again")
        self.what, self.work, self.timeout = what, work, timeout
        self.wait = timeout if wait is None else wait
        self._probe, self._rejoin, self._on_aside, self._died, self._away = probe, rejoin, on_aside, died, away
        count = len(self.names)
        self._pending: list[set[Ticket]] = [set() for _ in range(count)]
        self._answered = [time.monotonic()] * count
        self._dead: set[int] = set()
        self._aside: set[int] = set()
        self._retired: set[int] = set()
        self._probing: set[int] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="dew-pool-liveness") if probe else None
        # one thread per replica being probed, with room for replicas added later (threads start only when used)
        self._probes = ThreadPoolExecutor(count + 32, thread_name_prefix="dew-pool-probe") if probe else None
        if timeout is not None:
            threading.Thread(target=self._watch, name="dew-pool-watch", daemon=True).start()

    # ----- what stands where ---------------------------------------------------------------------

    def _is_dead(self, index: int) -> bool:
        """Under the lock: dead as the pool found it, or as the replica itself says."""
        if index not in self._dead and self._died is not None and self._died(index):
            self._dead.add(index)
        return index in self._dead

    def _live(self) -> list[int]:
        """Under the lock: the replicas that take work."""
        return [i for i in range(len(self.names))
                if not self._is_dead(i) and i not in self._aside and i not in self._retired]

    def live(self) -> list[int]:
        """The replicas that take work: not dead, not set aside."""
        with self._lock:
            return self._live()

    def dead(self) -> list[int]:
        with self._lock:
            return [i for i in range(len(self.names)) if self._is_dead(i)]

    def aside(self) -> list[int]:
        """The replicas set aside for not answering, or added and not caught up yet (not dead, not retired)."""
        with self._lock:
            return sorted(i for i in self._aside if not self._is_dead(i) and i not in self._retired)

    def retired(self) -> list[int]:
        with self._lock:
            return sorted(self._retired)

    # ----- membership ----------------------------------------------------------------------------

    def add(self, name: str) -> int:
        """A new replica ``name``; returns its index. It takes pieces once its probe answers and ``rejoin`` says it
        serves the newest weights (without a probe, at once)."""
        with self._lock:
            if str(name) in self.names:
                raise ValueError(f"the pool already has a {self.what} named {name!r}")
            self.names.append(str(name))
            self._pending.append(set())
            self._answered.append(time.monotonic())
            index = len(self.names) - 1
            if self._probe is not None:
                self._aside.add(index)
        self._probe_soon(index)
        return index

    def retire(self, index: int, timeout: float) -> int:
        """Take replica ``index`` out for good: no new piece goes to it, the pieces in flight get up to ``timeout``
        seconds to finish, and those still running then are abandoned (their callers run them again on the
        others). Returns how many were abandoned."""
        with self._lock:
            if index in self._retired:
                return 0
            self._retired.add(index)
        deadline = time.monotonic() + timeout
        while self.in_flight(index) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._abandon(index, ServerDied(f"{self.names[index]} was removed from the pool; its {self.work} "
                                               "go to the others"))

    def rename(self, index: int, name: str) -> None:
        """Call replica ``index`` ``name`` from now on (a replica that came back at another address)."""
        with self._lock:
            if str(name) in self.names[:index] + self.names[index + 1:]:
                raise ValueError(f"the pool already has a {self.what} named {name!r}")
            self.names[index] = str(name)

    def in_flight(self, index: int) -> int:
        with self._lock:
            return len(self._pending[index])

    # ----- pieces of work ------------------------------------------------------------------------

    def take(self) -> Ticket:
        """A ticket on the least busy live replica (see the module docstring for when none is live)."""
        for index in self.live() if self._away is not None else ():
            if self._away(index):
                self.set_aside(index, "it is gone from where it was; its host starts it again")
        ticket = self._take()
        if ticket is None and self.ready():  # one answered again
            ticket = self._take()
        if ticket is None:
            waited = f" (waited {self.wait:g} s for one to come back)" if self.wait is not None and self.aside() else ""
            raise RuntimeError(f"no {self.what} of the pool takes {self.work}: of {len(self.names)} started, "
                               f"{len(self.dead())} died and {len(self.aside())} stopped answering{waited}")
        return ticket

    def ready(self) -> bool:
        """Whether a replica takes work, waiting up to ``wait`` seconds for one set aside to come back when none
        does (as ``take`` does; a publisher about to load with every replica aside waits so too)."""
        if self.live():
            return True
        until = time.monotonic() + (self.wait or 0.0)
        while not self.live() and self.aside() and time.monotonic() < until:
            time.sleep(0.05)
        return bool(self.live())

    def _take(self) -> Ticket | None:
        with self._lock:
            live = self._live()
            if not live:
                return None
            index = min(live, key=lambda i: len(self._pending[i]))
            ticket = Ticket(index, time.monotonic())
            self._pending[index].add(ticket)
            return ticket

    def attach(self, ticket: Ticket, abandon: Callable[[BaseException], bool | None]) -> None:
        """How to stop and fail the ticket's piece if its replica is set aside (returning False when the piece had
        ended on its own first); run at once if it already was."""
        with self._lock:
            if ticket.abandoned is None:
                ticket.abandon = abandon
                return
        abandon(ticket.abandoned)

    def release(self, ticket: Ticket, *, failed: bool = False, died: bool = False) -> bool:
        """The piece ended: ``failed`` (its replica is then checked) or ``died`` (its replica is gone). False when
        the pool had abandoned it already: its outcome came late and is someone else's to drop."""
        with self._lock:
            if ticket.ended:
                return False
            ticket.ended = True
            index = ticket.replica
            self._pending[index].discard(ticket)
            if died:
                self._dead.add(index)
            else:
                self._answered[index] = time.monotonic()
            check = failed and self._checks is not None and not self._is_dead(index) and index not in self._aside
        if check:
            self._submit(self._checks, self._check, index)
        return True

    # ----- liveness ------------------------------------------------------------------------------

    def mark_dead(self, index: int, error: BaseException | None = None) -> None:
        """Leave replica ``index`` out for good; with ``error``, its pieces in flight are abandoned with it."""
        with self._lock:
            self._dead.add(index)
        if error is not None:
            self._abandon(index, error)

    def set_aside(self, index: int, why: str) -> None:
        """Stop giving work to replica ``index`` (silent: ``why``): abandon its pieces, tell ``on_aside``, probe it
        until it answers and rejoins."""
        with self._lock:
            if self._is_dead(index) or index in self._aside or index in self._retired:
                return
            self._aside.add(index)
        if self._on_aside is not None:
            self._on_aside(index)
        name = self.names[index]
        failed = self._abandon(index, ServerDied(f"{name} was set aside: {why}; its {self.work} go to the others"))
        logger.warning("%s set aside (%s); %d %s go to the others", name, why, failed, self.work)
        self._probe_soon(index)

    def sweep(self) -> None:
        """Probe every live replica now, at once, for up to ``timeout`` seconds: the silent are set aside, the gone
        left out (a publisher about to load calls it, so a load does not wait on a replica that stopped answering
        before the load began)."""
        if self._probe is None:
            return

        def ask(index: int) -> None:
            try:
                silent = self._probe(index, self.timeout or CHECK_TIMEOUT) is None
            except ServerDied:
                self.mark_dead(index)
                return
            if silent:
                self.set_aside(index, f"it answered nothing for {self.timeout or CHECK_TIMEOUT:g} s before a load")

        live = self.live()
        if live:
            with ThreadPoolExecutor(len(live), thread_name_prefix="dew-pool-sweep") as executor:
                wait([executor.submit(ask, index) for index in live])

    def _abandon(self, index: int, error: BaseException) -> int:
        with self._lock:
            pending, self._pending[index] = self._pending[index], set()
            for ticket in pending:
                ticket.ended, ticket.abandoned = True, error
            stops = [ticket.abandon for ticket in pending if ticket.abandon is not None]
        unattached = len(pending) - len(stops)  # abandoned when they are attached, just after they were sent
        # A piece whose outcome arrived just before (its release not yet run) keeps that outcome: not counted.
        return unattached + sum(stop(error) is not False for stop in stops)

    def _check(self, index: int) -> None:
        """A failed piece's replica: dead when its probe says it is gone (a silent one is the watch's to find)."""
        try:
            self._probe(index, CHECK_TIMEOUT)
        except ServerDied:
            self.mark_dead(index)

    def _silent_for(self, index: int) -> float:
        """Under the lock: seconds since the replica last answered while pieces wait on it (0 when none wait)."""
        pending = self._pending[index]
        if not pending:
            return 0.0
        return time.monotonic() - max(self._answered[index], min(ticket.sent for ticket in pending))

    def _watch(self) -> None:
        """Probe each replica that has pieces waiting and has said nothing for ``timeout`` seconds."""
        while not self._closed.wait(min(1.0, self.timeout / 4)):
            for index in range(len(self.names)):
                with self._lock:
                    quiet = (not self._is_dead(index) and index not in self._aside | self._probing | self._retired
                             and self._silent_for(index) >= self.timeout)
                if quiet:
                    self._probe_soon(index)

    def _probe_soon(self, index: int) -> None:
        if self._probes is None:
            return
        with self._lock:
            if index in self._probing or index in self._retired or self._closed.is_set():
                return
            self._probing.add(index)
        if not self._submit(self._probes, self._probe_until_settled, index):
            with self._lock:
                self._probing.discard(index)

    def _probe_until_settled(self, index: int) -> None:
        """Probe replica ``index`` until it answers (rejoining if it was set aside) or dies; set it aside while it
        does not."""
        name = self.names[index]
        try:
            while not self._closed.is_set() and index not in self._retired:
                asked = time.monotonic()
                try:
                    served = self._probe(index, self.timeout)
                except ServerDied as error:
                    self.mark_dead(index, error)
                    return
                except Exception as error:  # noqa: BLE001 - a probe that fails otherwise is no answer
                    logger.warning("probing %s failed: %r", name, error)
                    served = None
                with self._lock:
                    if served is not None:
                        self._answered[index] = time.monotonic()
                    silent = index in self._aside
                if served is not None and not silent:
                    return
                if served is None and silent:  # a replica being restarted refuses at once: not again at once
                    self._closed.wait(max(0.0, PROBE_PAUSE - (time.monotonic() - asked)))
                if served is not None:
                    if self._rejoined(index, served):
                        with self._lock:
                            self._aside.discard(index)
                        logger.warning("%s answers again and takes %s again", name, self.work)
                        return
                    self._closed.wait(self.timeout or CHECK_TIMEOUT)  # not caught up yet: ask again later
                elif not silent:
                    self.set_aside(index, f"it answered nothing for {2 * self.timeout:g} s with {self.work} waiting")
        finally:
            with self._lock:
                self._probing.discard(index)

    def _rejoined(self, index: int, served) -> bool:
        if self._rejoin is None:
            return True
        try:
            return bool(self._rejoin(index, served))
        except Exception as error:  # noqa: BLE001 - a catch-up that fails leaves the replica aside, probed again
            logger.warning("%s answers again but did not catch up: %r", self.names[index], error)
            return False

    def _submit(self, executor: ThreadPoolExecutor, function, index: int) -> bool:
        try:
            executor.submit(function, index)
        except RuntimeError:  # the pool closed meanwhile
            return False
        return True

    def close(self) -> None:
        """Stop probing; pieces in flight are their owners' to settle."""
        self._closed.set()
        for executor in (self._checks, self._probes):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)


class PooledRolloutServer(RolloutServer):
    """A RolloutServer over replica rollout servers (``servers``) that a ReplicaPool (``replicas``) spreads draws over.

    A draw goes to the least busy live server; ``cancel`` reaches the server that has it;
    a draw of a server set aside fails with ServerDied (``_abandon``: by default the draw's
    future alone, its request left to end unread). Subclasses build ``replicas`` over
    ``servers`` and give ``version`` and ``load``; ``start_draws`` must run first.
    """

    servers: list
    replicas: ReplicaPool

    def start_draws(self) -> None:
        self._owner: dict[int, int] = {}  # a draw's future (by id) -> its server, while it runs
        self._owner_lock = threading.Lock()

    def live(self) -> list[int]:
        """The servers that take draws: not dead, not set aside."""
        return self.replicas.live()

    def dead(self) -> list[int]:
        """The servers found dead."""
        return self.replicas.dead()

    def aside(self) -> list[int]:
        """The servers set aside for not answering."""
        return self.replicas.aside()

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        ticket = self.replicas.take()
        server = self.servers[ticket.replica]
        try:
            future = server.submit(prompt_ids, max_new_tokens, seed)
        except BaseException:
            self.replicas.release(ticket, failed=True)
            raise
        with self._owner_lock:
            self._owner[id(future)] = ticket.replica
        self.replicas.attach(ticket, lambda error: self._abandon(server, future, error))
        future.add_done_callback(lambda done: self._settled(ticket, done))
        return future

    def _settled(self, ticket: Ticket, done: DrawFuture) -> None:
        with self._owner_lock:
            self._owner.pop(id(done), None)
        self.replicas.release(ticket, failed=done.exception() is not None)

    def _abandon(self, server, future: DrawFuture, error: BaseException) -> bool:
        return settle(future, None, error)

    def cancel(self, draw: DrawFuture) -> None:
        with self._owner_lock:
            index = self._owner.get(id(draw))
        if index is not None:
            self.servers[index].cancel(draw)

    def close(self) -> None:
        self.replicas.close()
