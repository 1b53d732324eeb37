"""Weight broadcast from the trainer to rollout-server actors through Ray's object store.

``WeightBroadcast(actors, names=...)`` is a weights publisher the RolloutScheduler can
push through (``load(variables, version)`` and ``version``): the trainer's tree is
copied to host memory once, put in the object store once (``ray.put``), and every actor
loads that one object (actors on the trainer's node read it from shared memory without a
copy; others fetch it once per node). Each actor answers with the version it now serves;
the broadcast's ``version`` moves to ``version`` only when every actor loaded it, and a
failed or refused load raises in the trainer naming the actor. Actors that loaded before
one failed keep serving the new weights: the scheduler's next push loads them all again.
With ``drop_dead=True`` an actor that has died is not a failure: it leaves the broadcast
(its name is added to ``dropped``) and the others carry on; one that does not answer
within ``timeout`` seconds (stopped, not dead), or that Ray is restarting, is set aside
(its name is added to ``aside``): later loads skip it until ``rejoin(name)``, which first loads it with the
newest weights published (the broadcast keeps that one object alive for this), once the load it
did not answer has ended: Ray starts an async actor's tasks as their arguments resolve, not in
the order they were sent, so the older load could otherwise land after the newer and take the
served version back. When a load
finds every actor left set aside (a restart under way, a node lost with the others), the
load's weights become the newest and it waits up to ``wait`` seconds for one to rejoin with
them (the owner's probes call ``rejoin``); with none back by then, or none left at all,
``load`` raises.

An actor here is anything whose ``load.remote(variables, version)`` returns an ObjectRef
of the version it serves: :class:`dew_ray.actors.RolloutServerActor` is one. Publishers
for vLLM/SGLang replicas (safetensors reload, NCCL) plug in beside this one with the same
``load``/``version`` interface (:class:`dew.inference.WeightPublisher`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayTaskError

from dew.inference import WeightPublisher
from dew_ray.actor_loss import ACTOR_GONE


def host_tree(variables):
    """``variables`` as numpy arrays in host memory (device arrays copied once)."""
    return jax.tree.map(np.asarray, jax.device_get(variables))


def describe(error: BaseException) -> str:
    """The error an actor raised, without Ray's remote traceback around it."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    return f"{type(error).__name__}: {error}"


class WeightBroadcast(WeightPublisher):
    """Versioned weight publication to Ray actors (see the module docstring)."""

    def __init__(self, actors: Sequence, names: Sequence[str] | None = None, version: int = 0, timeout: float = 600.0,
                 drop_dead: bool = False, wait: float = 300.0, on_aside: Callable[[str, str], None] | None = None):
        actors = list(actors)
        if not actors:
            raise ValueError("WeightBroadcast needs at least one actor to publish to")
        names = list(names) if names is not None else [f"rollout server {i}" for i in range(len(actors))]
        if len(names) != len(actors):
            raise ValueError(f"got {len(names)} names for {len(actors)} actors")
        self.actors, self.names, self.timeout, self.drop_dead, self.wait = actors, names, timeout, drop_dead, wait
        self.on_aside = on_aside  # on_aside(name, why) for each actor a load sets aside: its owner probes it to rejoin
        self.dropped: list[str] = []
        self.aside: set[str] = set()
        self._lock = threading.Lock()
        self._version = version
        self._newest = None  # the object of the newest version published, for a set-aside actor's rejoin
        self._unanswered: dict[str, object] = {}  # by actor: the ObjectRef of a load it did not answer in time

    @property
    def version(self) -> int:
        return self._version

    @property
    def published(self) -> bool:
        """Whether this broadcast has published weights it can bring a rejoining actor to."""
        return self._newest is not None

    def add(self, actor, name: str) -> None:
        """A new actor ``name``, set aside until ``rejoin(name)`` loads it with the newest weights."""
        with self._lock:
            if name in self.names:
                raise ValueError(f"the broadcast already publishes to an actor named {name!r}")
            self.actors.append(actor)
            self.names.append(name)
            self.aside.add(name)

    def remove(self, name: str) -> None:
        """Publish to actor ``name`` no more."""
        with self._lock:
            index = self.names.index(name)
            del self.actors[index], self.names[index]
            self.aside.discard(name)
            self._unanswered.pop(name, None)

    def set_aside(self, name: str) -> None:
        """Leave ``name`` out of loads until ``rejoin(name)`` (its owner found it not answering)."""
        with self._lock:
            self.aside.add(name)

    def _put_aside(self, name: str, why: str) -> None:
        self.set_aside(name)
        if self.on_aside is not None:
            self.on_aside(name, why)

    def rejoin(self, name: str, serving: int | None = None, weights: tuple[object, int] | None = None) -> bool:
        """Load actor ``name`` (set aside) with the newest weights published, unless it is ``serving`` their
        version already, then include it in loads again; False (and it stays aside) when it does not load them
        within ``timeout`` seconds. ``weights`` (variables, version) are loaded instead, once, by a publisher that
        has published nothing and got them from whoever holds them; they do not become its newest."""
        with self._lock:
            actor, newest, version = self.actors[self.names.index(name)], self._newest, self._version
            earlier = self._unanswered.get(name)
        if weights is not None:
            newest, version = ray.put(host_tree(weights[0])), int(weights[1])
        if earlier is not None:  # it ends (lands or fails) before a newer load is sent: see the module docstring
            if not ray.wait([earlier], timeout=self.timeout)[0]:
                return False
            with self._lock:
                self._unanswered.pop(name, None)
        if newest is not None and serving != version:
            ref = actor.load.remote(newest, version)
            try:
                served = ray.get(ref, timeout=self.timeout)
            except GetTimeoutError:
                with self._lock:
                    self._unanswered[name] = ref
                return False
            except ACTOR_GONE:
                return False
            if served != version:
                return False
        with self._lock:
            self.aside.discard(name)
        return True

    def load(self, variables, version: int) -> None:
        """Put ``variables`` once and load it into every actor not set aside.

        Raises naming the first actor that failed (see the module docstring for the dead and the silent).
        """
        version = int(version)
        tree = ray.put(host_tree(variables))
        with self._lock:
            members = [(i, name, actor) for i, (name, actor) in enumerate(zip(self.names, self.actors))
                       if name not in self.aside]
        pending = [(index, name, actor.load.remote(tree, version)) for index, name, actor in members]
        answered = set(ray.wait([ref for _, _, ref in pending], num_returns=len(pending), timeout=self.timeout)[0]
                       if pending else [])
        failures, dead = [], []
        for index, name, ref in pending:
            if ref not in answered:
                silent = TimeoutError(f"it did not answer within {self.timeout:g} s")
                with self._lock:
                    self._unanswered[name] = ref
                if self.drop_dead:
                    self._put_aside(name, f"it did not load version {version} within {self.timeout:g} s")
                else:
                    failures.append((index, name, silent))
                continue
            try:
                served = ray.get(ref)
            except ActorUnavailableError as error:  # Ray restarts it: it rejoins once it answers
                if self.drop_dead:
                    self._put_aside(name, "its process was lost and Ray is restarting it")
                else:
                    failures.append((index, name, error))
                continue
            except ACTOR_GONE as error:
                (dead if self.drop_dead else failures).append((index, name, error))
                continue
            except Exception as error:  # noqa: BLE001 - every actor's outcome is collected before raising
                failures.append((index, name, error))
                continue
            if served != version:
                failures.append((index, name, RuntimeError(f"it serves version {served} after the load")))
        with self._lock:
            for index, name, _ in reversed(dead):
                del self.actors[index], self.names[index]
                self.dropped.append(name)
            serving = [name for name in self.names if name not in self.aside]
            wait_for_rejoin = not serving and bool(self.aside) and not failures
            if wait_for_rejoin:  # those set aside rejoin with these weights
                before, (self._version, self._newest) = (self._version, self._newest), (version, tree)
        waited = ""
        if wait_for_rejoin:
            serving = self._wait_for_rejoin()
            waited = f", waited {self.wait:g} s for one to come back"
            if not serving:
                with self._lock:
                    self._version, self._newest = before
        if not serving:
            raise RuntimeError(f"publishing version {version} failed: every actor has died or stopped answering "
                               f"(died: {', '.join(self.dropped) or 'none'}; set aside: "
                               f"{', '.join(sorted(self.aside)) or 'none'}{waited})")
        if failures:
            _, name, error = failures[0]
            others = f" (and {len(failures) - 1} more actor(s))" if len(failures) > 1 else ""
            raise RuntimeError(
                f"publishing version {version} failed on {name}{others}: {describe(error)}; "
                f"the broadcast stays at version {self._version}"
            ) from error
        with self._lock:
            self._version, self._newest = version, tree

    def _wait_for_rejoin(self) -> list[str]:
        """Up to ``wait`` seconds until an actor set aside has rejoined (loaded with the newest weights); those that
        serve then."""
        deadline = time.monotonic() + self.wait
        while True:
            with self._lock:
                serving = [name for name in self.names if name not in self.aside]
            if serving or not self.aside or time.monotonic() >= deadline:
                return serving
            time.sleep(0.2)
