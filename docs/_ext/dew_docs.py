"""Sphinx directives that generate reference pages from the code, so the pages cannot drift from it.

``config-fields``: the fields of a pydantic config model (``module:Class``) as a list, from the same
:func:`dew.config.field_rows` that ``dew-ray <command> --help`` prints.
``api-modules``: every module of a package (``:recursive:`` for its subpackages too), each
documented by autodoc from its docstrings, so a new module appears without editing a page.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

from dew.config import field_rows


def _load(reference: str):
    module, _, name = reference.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"config-fields: cannot load {reference!r} (module:Class): {error}") from None


def _parse(directive: Directive, lines: list[str]) -> list[nodes.Node]:
    """``lines`` of MyST Markdown (the pages' language: a nested parse in a MyST page reads Markdown) as nodes."""
    container = nodes.container()
    directive.state.nested_parse(StringList(lines, source=directive.arguments[0]), directive.content_offset,
                                 container)
    return container.children


def _role(match: re.Match) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"  # ~ shows the last name only


def _markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown: a role such as :class:`~a.B` becomes `B`, a double-backquoted
    literal a single-backquoted one."""
    return re.sub(r":[a-z]+:`(~?)([^`]+)`", _role, text).replace("``", "`")


class ConfigFields(Directive):
    """``config-fields`` with a ``module:Class`` argument: one list item per field (name, type, default, bounds,
    what it is)."""

    required_arguments = 1

    def run(self):
        kind = _load(self.arguments[0])
        lines = []
        for row in field_rows(kind):
            facts = ", ".join([f"`{row.type}`", "required" if row.default == "required" else f"default `{row.default}`",
                               *([row.constraints] if row.constraints else [])])
            what = _markdown(row.description)
            lines.append(f"- **`{row.name}`** ({facts}){': ' + what if what else ''}")
        return _parse(self, lines)


def package_modules(package: str, recursive: bool) -> list[tuple[str, bool]]:
    """``package`` and its modules as (name, is a package), sorted; with ``recursive`` its subpackages' modules too.
    Only packages are imported here: a module is left to autodoc, which mocks what ``autodoc_mock_imports`` names."""
    root = importlib.import_module(package)
    found = [(package, True)]
    for info in pkgutil.iter_modules(root.__path__, prefix=package + "."):
        if info.ispkg and recursive:
            found += package_modules(info.name, recursive)
        elif not info.ispkg:
            found.append((info.name, False))
    return found


class APIModules(Directive):
    """``api-modules`` with a package argument (and ``:recursive:``): an automodule per module; a package itself gets
    its docstring only, as its names are documented in the modules that define them."""

    required_arguments = 1
    option_spec = {"recursive": lambda value: True}

    def run(self):
        lines = ["```{eval-rst}"]  # autodoc writes reStructuredText, which a MyST page reads inside eval-rst only
        for name, package in package_modules(self.arguments[0], "recursive" in self.options):
            lines += [f".. automodule:: {name}", *([] if package else ["   :members:"]), ""]
        return _parse(self, lines + ["```"])


def setup(app):
    app.add_directive("config-fields", ConfigFields)
    app.add_directive("api-modules", APIModules)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
