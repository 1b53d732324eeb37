"""A config's ``"module:function"`` or ``"path/to/file.py:function"``: a user's function, by reference.

:func:`function_reference` resolves the string once, on the driver (importing it to name any
problem now), into a :class:`FunctionReference`: plain strings that pickle to every actor and
import there, once per process. The RLVR config's ``reward`` (a reward function) and
``environment`` (an environment factory) are read this way.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class FunctionReference:
    """A user's function by reference: ``file`` (an absolute path) or ``module`` found under ``search``.

    It pickles as these strings and imports where it is called (a trainer actor on another
    node needs the same path there), once per process; calling it calls the function.
    ``field`` is the config field that named it, for errors.
    """

    spec: str
    function: str
    file: str | None = None
    module: str | None = None
    search: str | None = None
    field: str = "reward"

    def load(self) -> Callable:
        return _load(self)

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)


@functools.cache
def _load(reference: FunctionReference):
    field = reference.field
    if reference.file is not None:
        path = Path(reference.file)
        if not path.is_file():
            raise ValueError(f"config field {field!r} ({reference.spec!r}): {path} does not exist on this node")
        name = f"dew_{field}_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling inside the file look themselves up by name
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            raise ValueError(f"config field {field!r} ({reference.spec!r}): running {path} raised "
                             f"{type(error).__name__}: {error}") from error
    else:
        if reference.search and reference.search not in sys.path:
            sys.path.append(reference.search)
        module = importlib.import_module(reference.module)
    function = getattr(module, reference.function, None)
    if not callable(function):
        where = reference.file or reference.module
        raise ValueError(f"config field {field!r} ({reference.spec!r}): {where} has no function "
                         f"{reference.function!r}")
    return function


def function_reference(spec: str, field: str, cwd: str | Path | None = None) -> FunctionReference:
    """Resolve ``"module:function"`` or ``"path/file.py:function"`` (config field ``field``) now, importing it once.

    A path (ending in ``.py``) resolves against ``cwd`` (default: the working directory); a
    module is looked up on ``sys.path`` and then in ``cwd``, so a file beside the command
    imports without setting PYTHONPATH. The error says what was searched.
    """
    target, sep, function = spec.rpartition(":")
    if not sep or not target or not function.isidentifier():
        raise ValueError(f"config field {field!r} must be \"module:function\" or \"path/to/file.py:function\", "
                         f"got {spec!r}")
    cwd = Path(cwd or Path.cwd()).resolve()
    if target.endswith(".py") or "/" in target:
        path = (cwd / Path(target).expanduser()).resolve()
        if not path.is_file():
            raise ValueError(f"config field {field!r} ({spec!r}): {path} is not a file (a relative path resolves "
                             f"against the working directory, {cwd})")
        reference = FunctionReference(spec, function, file=str(path), field=field)
    else:
        search, top = None, target.split(".")[0]
        if importlib.util.find_spec(top) is None:
            if not (cwd / f"{top}.py").exists() and not (cwd / top).is_dir():
                raise ValueError(f"config field {field!r} ({spec!r}): no module {target!r} on sys.path or in the "
                                 f"working directory {cwd}; give a file path instead, such as "
                                 f"\"{field}s.py:{function}\"")
            search = str(cwd)
        reference = FunctionReference(spec, function, module=target, search=search, field=field)
    try:
        reference.load()
    except ImportError as error:
        raise ValueError(f"config field {field!r} ({spec!r}): importing {target!r} failed ({error})") from None
    return reference
