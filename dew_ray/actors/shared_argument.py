"""A large constructor argument several restartable actors share: put once, passed by reference.

Ray logs an error line (``core_worker.cc ... has constructor arguments in the object store and
max_restarts > 0``) for every restartable actor whose constructor takes an object from the object
store: if the object went out of scope the actor could not be restarted. The runs keep such an
object alive for as long as the actors may restart (a rollout servers' pool holds its task, the
pipeline its environment build), so on every run the line only read as a failure.
``SharedArgument(ray.put(value))`` is a small argument Ray passes inline; :func:`resolved`, in the
actor's constructor, fetches the value (once more after a restart).
"""

from __future__ import annotations

import dataclasses

import ray


@dataclasses.dataclass(frozen=True)
class SharedArgument:
    """An object in Ray's object store that actors' constructors read (see the module docstring)."""

    ref: ray.ObjectRef


def resolved(value):
    """``value``, or the object a :class:`SharedArgument` refers to."""
    return ray.get(value.ref) if isinstance(value, SharedArgument) else value
