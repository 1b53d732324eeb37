"""Constructor arguments a restartable actor reads by name, so that a restart never depends on Ray keeping them.

Ray runs a restarted actor's constructor again on the arguments it was first given. An argument that lives in
Ray's object store (an ObjectRef, a value Ray puts there itself because it is large, or an actor handle inside
any argument) is there only while some process holds it, and Ray prints an error line (once per process) when it
creates an actor that has such an argument and ``max_restarts`` (``CoreWorker::CreateActor`` in Ray's
core_worker.cc; ray-project/ray#53727). Every dew-ray run printed it, and it read as a failure.

:func:`keep` puts a value in the object store once and leaves its reference with the job's
:class:`ArgumentKeeper`: one named actor per Ray job (the driver's), on the node that first asked for it. A
constructor is given the small :class:`Kept` instead (the keeper's name and a key, no reference) and calls
:func:`unkept` on it: the first start and every restart read the same value, for as long as it is kept.
``Kept.release()`` lets it go; the pool or worker that kept it does so when it closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class ArgumentKeeper:
    """The kept values' references by key (each in a one-item list, so Ray hands the reference, not the value).

    An async actor: :func:`keep` does not wait for the keeper to start (a worker process, seconds on a busy node),
    so a constructor may ask for a key before the driver's call that keeps it arrives; ``fetch`` waits for it, up
    to ``wait`` seconds."""

    def __init__(self, wait: float = 300.0):
        self.wait = wait
        self._kept: dict[str, list] = {}
        self._arrived: dict[str, asyncio.Event] = {}
        self._released: set[str] = set()

    async def keep(self, key: str, boxed: list) -> None:
        self._kept[key] = boxed
        self._arrived.setdefault(key, asyncio.Event()).set()

    async def fetch(self, key: str) -> list:
        if key in self._released:
            raise KeyError(f"the constructor argument kept as {key!r} was released: the pool or worker that kept it "
                           "closed, so no actor is to be built from it again")
        try:
            await asyncio.wait_for(self._arrived.setdefault(key, asyncio.Event()).wait(), self.wait)
        except asyncio.TimeoutError:
            raise KeyError(f"no constructor argument was kept as {key!r} within {self.wait:.0f} s") from None
        if key in self._released:  # released while this call waited
            raise KeyError(f"the constructor argument kept as {key!r} was released")
        return self._kept[key]

    async def release(self, key: str) -> None:
        self._kept.pop(key, None)
        self._released.add(key)
        waiting = self._arrived.pop(key, None)
        if waiting is not None:  # a fetch still waiting for the key wakes and names it released, not at its timeout
            waiting.set()

    async def keys(self) -> list[str]:
        return sorted(self._kept)


ArgumentKeeperActor = ray.remote(ArgumentKeeper)


@dataclasses.dataclass(frozen=True)
class Kept:
    """A value kept by the job's ArgumentKeeper (see the module docstring): pickles as three short strings."""

    keeper: str
    namespace: str
    key: str

    def value(self):
        """The kept value (KeyError naming the key once it was released, or when it never arrives)."""
        keeper = ray.get_actor(self.keeper, namespace=self.namespace)
        [reference] = ray.get(keeper.fetch.remote(self.key))
        return ray.get(reference)

    def release(self) -> None:
        """Let the value go: actors restarted later cannot be built from it."""
        ray.get(ray.get_actor(self.keeper, namespace=self.namespace).release.remote(self.key))


def keeper_name() -> str:
    """The job's ArgumentKeeper's name."""
    return f"dew-kept-arguments-{ray.get_runtime_context().get_job_id()}"


# The handles of the keepers this process started, by cluster (its GCS address and this process's node, which a
# new cluster numbers anew) and name: Ray ends a named actor once the handle that created it is gone, and the keeper
# is to live as long as the job's driver.
_started: dict[tuple[str, str, str, str], object] = {}


def keeper_actor(name: str, namespace: str):
    """The keeper named ``name``, started on this node when this process has not started it yet. It holds no CPU, and
    it is placed on this node even from inside a placement group: the run lives as long as its driver's node anyway."""
    context = ray.get_runtime_context()
    where = (context.gcs_address, context.get_node_id(), name, namespace)
    if where not in _started:
        node = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
        _started[where] = ArgumentKeeperActor.options(name=name, namespace=namespace, get_if_exists=True, num_cpus=0,
                                                      scheduling_strategy=node).remote()
    return _started[where]


def put_once(value) -> ray.ObjectRef:
    """``value`` put in the object store, or ``value`` itself when it is an ObjectRef already."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


def keep(value) -> Kept:
    """Keep ``value`` (or an ObjectRef) for restartable actors' constructors; returns the :class:`Kept` to give them.
    Call it from the driver: the keeper lives as long as the process that started it."""
    kept = Kept(keeper_name(), ray.get_runtime_context().namespace, uuid.uuid4().hex)
    # not waited for: the constructors' fetch waits for it, while the keeper and the actors start side by side
    # (Ray holds the reference for the call until the keeper has it)
    keeper_actor(kept.keeper, kept.namespace).keep.remote(kept.key, [put_once(value)])
    return kept


def unkept(argument):
    """A constructor's argument as it was given to :func:`keep`, or as it is when it was not kept."""
    return argument.value() if isinstance(argument, Kept) else argument
