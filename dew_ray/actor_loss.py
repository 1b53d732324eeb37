"""How Ray says a call failed for want of its actor, read the same way by every pool and publisher of the Ray layer.

``ACTOR_GONE`` is what an actor that will not answer again raises: it died past its restarts
(``RayActorError``), or Ray cannot place it again because its placement group was removed (a fleet
removal while Ray was restarting it after a crash: "Required placement group ... is removed").
:func:`actor_lost` tells those from an actor Ray is starting again.
"""

from __future__ import annotations

from ray.exceptions import ActorPlacementGroupRemoved, ActorUnavailableError, ActorUnschedulableError, RayActorError

ACTOR_GONE = (RayActorError, ActorUnschedulableError, ActorPlacementGroupRemoved)


def actor_lost(error: BaseException | None) -> str | None:
    """How Ray says a call failed for want of its actor: "restarting" (``ActorUnavailableError``: its process or node
    was lost and Ray is starting it again), "dead" (any other ``RayActorError``, or Ray cannot place it again:
    ``ACTOR_GONE``; no restart is coming), or None (the call failed some other way, or did not fail)."""
    if isinstance(error, ActorUnavailableError):
        return "restarting"
    return "dead" if isinstance(error, ACTOR_GONE) else None
