"""Typed run configuration: pydantic models, read from TOML files and ``key=value`` overrides.

Every pipeline's options are a :class:`Config` (a frozen, strict pydantic model that
refuses unknown fields, booleans for numbers and non-finite floats), and
:func:`load_config` reads one the same way for all of them: a TOML file (flat keys, or
under a table named for the pipeline), then ``key=value`` overrides (each value read as
its field's type by pydantic's own lax parsing, ``none``/``null`` meaning None where the
field allows it), then keyword values. A bad value raises :class:`ConfigError` naming the
field, the value and what was expected:

    config field 'servers' must be an integer >= 1, got 0
"""

from __future__ import annotations

import re
import textwrap
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

C = TypeVar("C", bound="Config")

_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


class ConfigError(ValueError):
    """A configuration value that does not fit its field; the message names the field."""


def _expected(error: Mapping[str, Any], annotation: Any = None) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"{'an integer' if annotation is int else 'a number'} {_BOUNDS[kind]} {bound:g}"
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    return _EXPECTED.get(kind, error["msg"].removeprefix("Input should be ").lower())


def describe(error: ValidationError, kind: type[BaseModel] | None = None) -> str:
    """One line per problem: ``config field 'x' must be ..., got ...`` (a cross-field rule gives its own message).

    ``kind`` is the model, whose field types say whether a bound is on an integer or a number.
    """
    lines = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item["loc"])
        known = kind.model_fields.get(str(item["loc"][0])) if kind is not None and item["loc"] else None
        if item["type"] == "extra_forbidden":
            lines.append(_unknown(kind, field) if kind is not None else f"unknown config field {field!r}")
        elif item["type"] == "value_error" and not field:
            lines.append(str(item["ctx"]["error"]) if "ctx" in item else item["msg"])
        elif item["type"] == "value_error":
            lines.append(f"config field {field!r}: {item['ctx']['error'] if 'ctx' in item else item['msg']}")
        else:
            expected = _expected(item, None if known is None else known.annotation)
            lines.append(f"config field {field!r} must be {expected}, got {item['input']!r}")
    return "; ".join(lines)


class Config(BaseModel):
    """Base of every run configuration (see the module docstring); values are checked when it is built.

    ``synonyms``: names other tools give these fields (verl's ``max_response_length`` for
    ``max_new_tokens``), which an unknown-field error points from to the field.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
    synonyms: ClassVar[dict[str, str]] = {}

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise ConfigError(describe(error, type(self))) from None


def _unknown(kind: type[BaseModel], name: str, where: str = "") -> str:
    """The error for a field ``kind`` does not have, pointing a synonym to its field."""
    field = getattr(kind, "synonyms", {}).get(name)
    hint = f" (other tools' name for {field!r}: set {field!r})" if field else ""
    return f"unknown config field {name!r}{where}{hint}; known: {sorted(kind.model_fields)}"


def _override(kind: type[Config], item: str) -> tuple[str, Any]:
    name, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"an override must read key=value, got {item!r}")
    field = kind.model_fields.get(name)
    if field is None:
        raise ConfigError(_unknown(kind, name, f" in override {item!r}"))
    adapter = TypeAdapter(field.annotation)
    if text.lower() in ("none", "null"):
        try:
            return name, adapter.validate_python(None)
        except ValidationError:
            pass
    try:
        if get_origin(field.annotation) is list:  # a JSON list, or comma-separated items: trackers=tensorboard,wandb
            if text.lstrip().startswith("["):
                return name, adapter.validate_json(text, strict=False)
            return name, adapter.validate_python([part.strip() for part in text.split(",") if part.strip()],
                                                 strict=False)
        if get_origin(field.annotation) is dict:  # a JSON object: server_resources={"rollout": 1}
            return name, adapter.validate_json(text, strict=False)
        return name, adapter.validate_python(text, strict=False)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        expected = ('a JSON object, such as {"name": 1}' if first["type"] == "json_invalid"
                    else _expected(first, field.annotation))
        raise ConfigError(f"cannot read {text!r} as config field {name!r} ({expected})") from None


def load_config(kind: type[C], path: str | Path | None = None, overrides: Iterable[str] = (), table: str | None = None,
                **values: Any) -> C:
    """A ``kind`` from the TOML file ``path`` (flat, or under ``[table]``), then ``key=value`` overrides, then values."""
    merged: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path} is not valid TOML: {error}") from None
        if table is not None and isinstance(data.get(table), dict):
            data = data[table]
        unknown = sorted(set(data) - set(kind.model_fields))
        if unknown:
            raise ConfigError(f"{path}: {_unknown(kind, unknown[0])}")
        merged.update(data)
    merged.update(_override(kind, item) for item in overrides)
    merged.update(values)
    return kind(**merged)


_DOC_ENTRY = re.compile(r"(?:^|[;.:]\s+|\n\s*)((?:[a-z_][a-z0-9_]*)(?:,\s*[a-z_][a-z0-9_]*)*):\s+(.+?)(?=;\s|\.\s|$)", re.S)


def field_descriptions(kind: type[BaseModel]) -> dict[str, str]:
    """Each field's one-line description, read from the ``name: what it is;`` entries of the model's docstrings."""
    found: dict[str, str] = {}
    for cls in kind.__mro__:
        for names, text in _DOC_ENTRY.findall(cls.__dict__.get("__doc__") or ""):
            for name in (n.strip() for n in names.split(",")):
                if name in kind.model_fields and name not in found:
                    found[name] = " ".join(text.split())
    return found


class FieldRow(NamedTuple):
    """One config field as ``--help`` and the documentation's configuration reference list it."""

    name: str
    type: str
    default: str  # the default's repr, or "required"
    constraints: str  # pydantic's bounds, such as ">= 1, < 1", or ""
    description: str  # from the model's docstrings (:func:`field_descriptions`), or ""


_CONSTRAINTS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="),
                ("max_length", "length <="))


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(?:[a-z_]\w*\.)+(?=[A-Za-z_])", "", str(annotation))  # typing.Literal, pkg.mod.Class: the name


def _bound(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def field_rows(kind: type[BaseModel]) -> list[FieldRow]:
    """Every field of ``kind`` in declaration order: type, default, bounds and description."""
    notes = field_descriptions(kind)
    rows = []
    for name, field in kind.model_fields.items():
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        bounds = [f"{symbol} {_bound(getattr(item, key))}"
                  for item in field.metadata for key, symbol in _CONSTRAINTS if getattr(item, key, None) is not None]
        rows.append(FieldRow(name, _type_name(field.annotation), default, ", ".join(bounds), notes.get(name, "")))
    return rows


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]*?)(?:\s*<[^`]*>)?`")  # :class:`~dew.x.Y`, :func:`a <b>`


def plain_text(text: str) -> str:
    """Docstring prose as a terminal shows it: Sphinx roles become their target's name (the last part, for a
    ``~`` one), literals lose their backquotes."""
    def name(found: re.Match) -> str:
        target = found.group(1)
        return target.rsplit(".", 1)[-1] if found.group(0).startswith(":") and "`~" in found.group(0) else target

    return _ROLE.sub(name, text).replace("``", "")


def fields_help(kind: type[BaseModel], width: int = 110) -> str:
    """The config fields of ``kind`` for ``--help``: name, type, default and bounds on one line, then what it is,
    wrapped to ``width``; fields that share one description (``a, b: ...`` in the docstring) print it once."""
    lines = [f"config fields (--set NAME=VALUE, or NAME = VALUE in the TOML file), from {kind.__name__}:"]
    described: dict[str, str] = {}  # description -> the first field that printed it
    for row in field_rows(kind):
        default = "required" if row.default == "required" else f"default {row.default}"
        lines.append(f"  {row.name} ({row.type}, {default}{', ' + row.constraints if row.constraints else ''})")
        if row.description in described:
            lines.append(f"      see {described[row.description]}")
        elif row.description:
            described[row.description] = row.name
            lines += textwrap.wrap(plain_text(row.description), width, initial_indent="      ",
                                   subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)
