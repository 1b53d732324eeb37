"""Option checks shared by every constructor: each returns the value or raises ``ValueError`` naming it.

``integer("rows", rows, at_least=2)`` reads "rows must be an integer >= 2, got 0";
``why`` adds the reason after the rule ("groups must be an integer >= 2 (advantages
compare completions of one prompt), got 1"). Booleans are refused wherever a number is
asked for, since ``True`` is an ``int`` to Python and never what a caller meant.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any


def _fail(name: str, rule: str, value: Any, why: str) -> ValueError:
    reason = f" ({why})" if why else ""
    return ValueError(f"{name} must be {rule}{reason}, got {value!r}")


def integer(name: str, value: Any, at_least: int | None = None, why: str = "") -> int:
    """``value`` as an int: an integer (numpy's too, never a bool), at least ``at_least`` when given."""
    rules = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
    rule = rules.get(at_least, f"an integer >= {at_least}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (at_least is not None and value < at_least):
        raise _fail(name, rule, value, why)
    return int(value)


def positive_int(name: str, value: Any, why: str = "") -> int:
    """``value`` as an int >= 1."""
    return integer(name, value, at_least=1, why=why)


def number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
           below: float | None = None, at_most: float | None = None, finite: bool = True, why: str = "") -> float:
    """``value`` as a float: a real number (never a bool), finite unless ``finite=False``, within the bounds given."""
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if at_least is not None:
        parts.append(f">= {at_least:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    if at_most is not None:
        parts.append(f"<= {at_most:g}")
    rule = ("a finite number" if finite else "a number") + (" " + " and ".join(parts) if parts else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, rule, value, why)
    value = float(value)
    if (math.isnan(value) or (finite and math.isinf(value)) or (above is not None and not value > above)
            or (at_least is not None and not value >= at_least) or (below is not None and not value < below)
            or (at_most is not None and not value <= at_most)):
        raise _fail(name, rule, value, why)
    return value


def positive(name: str, value: Any, why: str = "") -> float:
    """``value`` as a finite float > 0."""
    return number(name, value, above=0, why=why)


def one_of(name: str, value: Any, allowed: Collection) -> Any:
    """``value`` when it is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def distinct(name: str, values: Collection, why: str = "") -> list:
    """``values`` as a list, when no value repeats ("stage names must differ (...), got ['a', 'a']")."""
    values = list(values)
    if len(set(values)) != len(values):
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must differ{reason}, got {values!r}")
    return values


def band(name: str, value: Any, strict: bool = False) -> tuple[float, float]:
    """``(low, high)`` as finite floats with ``0 < low <= high`` (``low < high`` when ``strict``)."""
    rule = f"a (low, high) pair with 0 < low {'<' if strict else '<='} high"
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    low, high = number(f"{name}[0]", value[0], above=0), number(f"{name}[1]", value[1], above=0)
    if low > high or (strict and low == high):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return low, high
