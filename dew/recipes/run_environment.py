"""A run's multi-turn environment: the config's ``environment``, resolved and built where sessions run.

``environment`` names a factory: ``"calculator"`` (the built-in one,
:mod:`dew.recipes.calculator_environment`) or a user's ``"module:factory"`` /
``"path/to/file.py:factory"`` (:func:`~dew.recipes.function_reference.function_reference`).
A factory is called once in each process that runs sessions (every environment worker, and
the driver for the held-out measure) with an :class:`EnvironmentSetup` and returns
``(environment, verifier)`` as :class:`~dew.collection.sources.EnvironmentSource` takes them:
``environment(task, identity)`` an :class:`~dew.records.episode_protocol.Environment` whose
``reset`` returns the task's ``prompt_ids`` (or a context built from the task's data), and
``verifier(task, episode)`` a float. :func:`build_environment` calls it and names a factory
that returns anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from dew.recipes.calculator_environment import calculator
from dew.recipes.function_reference import function_reference

BUILT_IN = {"calculator": calculator}


@dataclasses.dataclass(frozen=True)
class EnvironmentSetup:
    """What an environment factory gets: the run's tokenizer, its reward (the Prompts signature,
    ``reward(data_source, completion, ground_truth, extra_info)``), the ids that end a response and
    the most model calls an episode makes."""

    tokenizer: object
    reward: Callable[[str, str, str, str], float]
    eos_ids: tuple[int, ...]
    max_turns: int


def environment_factory(spec: str, cwd: str | Path | None = None) -> Callable:
    """The factory config field ``environment`` names: a built-in one by name, or a user's, imported once now."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    if ":" not in spec:
        raise ValueError(f"config field 'environment' must be one of {sorted(BUILT_IN)}, \"module:factory\" or "
                         f"\"path/to/file.py:factory\", got {spec!r}")
    return function_reference(spec, "environment", cwd)


def build_environment(factory: Callable, setup: EnvironmentSetup) -> tuple[Callable, Callable]:
    """``factory(setup)``, checked to be an ``(environment, verifier)`` pair of callables."""
    built = factory(setup)
    if not (isinstance(built, tuple) and len(built) == 2 and all(callable(part) for part in built)):
        raise TypeError(f"the environment factory {factory!r} returned {built!r}; it must return (environment, "
                        "verifier): environment(task, identity) -> Environment, verifier(task, episode) -> float")
    return built
