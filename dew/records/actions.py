"""The one validator of model actions: live draws, imported rows and journal-restored turns all pass here.

An action is the context a model call read, the ids it sampled and the likelihoods the
engine reported for them. :func:`check_action` refuses an empty context, token ids that
are not non-negative integers (booleans included: ``True`` is an ``int`` to Python),
likelihoods that are not one finite value per sampled id (behaviour log-probabilities
also at most 0), a termination flag that disagrees with the configured EOS ids and ids
after an EOS. The vocabulary's upper bound is the caller's to check: only it knows the
model. :func:`check_call` applies it, with the router and support records, to every
:class:`~dew.records.session_records.Call` that reaches ``pack``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import numpy as np


def token_ids(name: str, values: Iterable[int], nonempty: bool = False) -> tuple[int, ...]:
    """``values`` (a list, tuple or 1-D array) as a tuple of ``int``; ``ValueError`` naming ``name`` unless all
    are non-negative integers."""
    if isinstance(values, (str, bytes, Mapping, AbstractSet)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be an ordered sequence of token ids, got {type(values).__name__}")
    values = tuple(values)
    if nonempty and not values:
        raise ValueError(f"{name} must hold at least one token id")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name}[{index}] must be a non-negative integer token id (not a bool), got {value!r}")
    return tuple(int(value) for value in values)


def _likelihoods(where: str, name: str, values, count: int, log_probabilities: bool) -> None:
    if values is None:
        return
    if isinstance(values, (str, bytes)) or len(values) != count:
        got = "a string" if isinstance(values, (str, bytes)) else f"{len(values)}"
        raise ValueError(f"{where}: {got} {name} for {count} sampled ids; the engine must report one per sampled id")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{where}: {name}[{index}] must be a number, got {value!r}")
    array = np.asarray(values, np.float64)
    if count and (not np.isfinite(array).all() or (log_probabilities and (array > 1e-6).any())):
        bound = " log-probabilities (<= 0)" if log_probabilities else " numbers"
        raise ValueError(f"{where}: {name} must be finite{bound}, got {array.tolist()}")


def check_action(where: str, context: Sequence[int], sampled: Sequence[int], behavior_log_probs: Sequence[float],
                 old_log_probs: Sequence[float] | None = None, eos: bool | None = None,
                 eos_ids: Iterable[int] = (), names: tuple[str, str] = ("context", "sampled ids"),
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check one action (see the module docstring); returns (context, sampled) as tuples of int.

    ``where`` names the action in messages ("session (task '3', ...), call 1"). ``eos``
    is the action's termination flag (None: not recorded); with ``eos_ids`` an EOS id
    may only end the sampled ids, and a recorded flag must say whether one does. ``names``
    are the two id fields' names in the caller's record (a Call's "prompt_ids", "sampled_ids").
    """
    context = token_ids(f"{where}: {names[0]}", context, nonempty=True)
    sampled = token_ids(f"{where}: {names[1]}", sampled)
    _likelihoods(where, "behavior_log_probs", behavior_log_probs, len(sampled), log_probabilities=True)
    _likelihoods(where, "old_log_probs", old_log_probs, len(sampled), log_probabilities=False)
    if eos is not None and not isinstance(eos, bool):
        raise ValueError(f"{where}: the termination flag must be a bool, got {eos!r}")
    stops = frozenset(int(i) for i in eos_ids)
    if stops:
        early = [index for index, token in enumerate(sampled[:-1]) if token in stops]
        if early:
            raise ValueError(f"{where}: sampled id {early[0]} is an EOS id ({sampled[early[0]]}) with "
                             f"{len(sampled) - early[0] - 1} id(s) after it; nothing is sampled after EOS")
        ended = bool(sampled) and sampled[-1] in stops
        if eos is not None and eos != ended:
            raise ValueError(f"{where}: the termination flag says eos={eos} but the sampled ids "
                             f"{'end' if ended else 'do not end'} with an EOS id of {sorted(stops)}")
    return context, sampled


def check_call(where: str, call, eos_ids: Iterable[int] = ()) -> None:
    """Check a :class:`~dew.records.session_records.Call` before packing: the action, its support and router records."""
    eos = None if call.finish_reason not in ("stop", "length") else call.finish_reason == "stop"
    check_action(where, call.prompt_ids, call.sampled_ids, call.behavior_log_probs, call.old_log_probs,
                 eos=eos if eos_ids else None, eos_ids=eos_ids, names=("prompt_ids", "sampled_ids"))
    sampled = len(call.sampled_ids)
    if call.support is not None and len(call.support) != sampled:
        raise ValueError(f"{where}: {len(call.support)} support entries for {sampled} sampled ids")
    if call.routed_experts is not None:
        record = np.asarray(call.routed_experts)
        if record.ndim != 3 or record.shape[0] > len(call.prompt_ids) + sampled:
            raise ValueError(
                f"{where}: routed_experts must be [ids covered <= {len(call.prompt_ids) + sampled}, layers, top_k], "
                f"got shape {record.shape}"
            )
