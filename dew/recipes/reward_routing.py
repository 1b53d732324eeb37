"""An RL run's rewards: each completion routed by ``data_source``, or a user's own function.

Reward routing belongs with the recipe, not with the data: :mod:`dew.data.verifiable` makes
the tasks, and this module puts MathReward, GSM8KReward and CodeReward (in a SandboxFleet)
behind one reward callable (:func:`verifiable_reward`; :meth:`RoutedReward.check_sources`
refuses a data source no route scores before any work). :class:`CachedCodeReward` runs
each distinct program once per task. :func:`reward_function` resolves a config's
``"module:function"`` or ``"path/to/file.py:function"`` into a
:class:`~dew.recipes.function_reference.FunctionReference` that pickles to other processes
and loads there.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from dew.recipes.function_reference import FunctionReference, function_reference
from dew.data.verifiable import CODE_HARNESS, CODE_SOURCE, MATH_SOURCE, WORD_SOURCE
from dew.sandbox.verifiable_rewards import CodeReward, GSM8KReward, LastNumberReward, MathReward, last_python_block
from dew.validation import positive_int

GSM8K_SOURCE = "openai/gsm8k"
# The competition-math data sources verl's default_compute_score grades with its math rule; MathReward reads \boxed{}.
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


VERIFIABLE_SOURCES = (MATH_SOURCE, CODE_SOURCE, WORD_SOURCE, GSM8K_SOURCE, *MATH_SOURCES)  # verifiable_reward's routes


def check_sources(sources: Iterable[str], routes: Iterable[str], where: str = "the prompts") -> None:
    """Refuse data sources that no route scores, naming them and the routes, before any draw is scored."""
    unknown = sorted(set(sources) - set(routes))
    if unknown:
        raise ValueError(f"{where} hold data_source {', '.join(map(repr, unknown))}, which no reward route "
                         f"scores; the routes are {sorted(routes)} (or set config field 'reward' to "
                         "\"module:function\" or \"file.py:function\", a function of your own)")


class RoutedReward:
    """A reward that hands each completion to the reward registered for its ``data_source``.

    ``routes`` maps data sources to rewards with the signature
    ``(data_source, completion, ground_truth, extra_info) -> float``. An unknown data
    source raises ValueError naming the known ones (a dataset bug, not a model failure),
    unless ``default`` names the route that scores every other data source.
    """

    def __init__(self, routes: Mapping[str, Callable[[str, str, str, str], float]], default: str | None = None):
        if not isinstance(routes, Mapping) or not routes:
            raise ValueError(f"routes must be a non-empty mapping of data_source -> reward, got {routes!r}")
        for source, reward in routes.items():
            if not isinstance(source, str) or not callable(reward):
                raise TypeError(f"routes must map data_source strings to callables, got {source!r}: {reward!r}")
        if default is not None and default not in routes:
            raise ValueError(f"default must be one of the routes {sorted(routes)}, got {default!r}")
        self.routes, self.default = dict(routes), default

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        reward = self.routes.get(data_source, self.routes.get(self.default))
        if reward is None:
            raise ValueError(f"no reward for data_source {data_source!r}; known: {sorted(self.routes)}")
        return reward(data_source, completion, ground_truth, extra_info)

    def check_sources(self, sources: Iterable[str], where: str = "the prompts") -> None:
        """Refuse data sources that no route scores (and no default covers): :func:`check_sources`."""
        if self.default is None:
            check_sources(sources, self.routes, where)

    def __repr__(self) -> str:
        return f"RoutedReward({self.routes!r})"


class CachedCodeReward:
    """A CodeReward that runs each distinct program once per ground truth and reuses its score.

    Samples of one group often write the same program (a small policy becomes sharp
    quickly), and running it again would only repeat the same test cases. The key is
    the completion's last python block and the ground truth, so completions that
    differ outside the block share a score. This assumes the programs are
    deterministic, as the built-in tasks' are; a program that timed out once keeps its
    score. ``size`` bounds the entries kept (the oldest go first).
    """

    def __init__(self, reward, size: int = 4096):
        positive_int("size", size)
        if not callable(reward):
            raise TypeError(f"reward must be callable, got {reward!r}")
        self.reward, self.size = reward, size
        self._scores: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        block = last_python_block(completion) if isinstance(completion, str) else None
        if block is None:  # nothing would run: no need to remember it
            return self.reward(data_source, completion, ground_truth, extra_info)
        key = (block, ground_truth)
        with self._lock:
            if key in self._scores:
                self._scores.move_to_end(key)
                self.hits += 1
                return self._scores[key]
            self.misses += 1
        score = self.reward(data_source, completion, ground_truth, extra_info)  # outside the lock: it waits on programs
        with self._lock:
            self._scores[key] = score
            while len(self._scores) > self.size:
                self._scores.popitem(last=False)
        return score

    def __repr__(self) -> str:
        return f"CachedCodeReward({self.reward!r}, size={self.size})"


def verifiable_reward(fleet, all_or_nothing: bool = False, cache: bool = True, default: str | None = None) -> RoutedReward:
    """The verifiable routes: MathReward for ``MATH_SOURCE`` and :data:`MATH_SOURCES`, verl's GSM8K rule
    (GSM8KReward, strict) for ``openai/gsm8k``, LastNumberReward for ``WORD_SOURCE`` (the built-in word
    problems), CodeReward on ``fleet`` for ``CODE_SOURCE``.

    Code completions run under :data:`CODE_HARNESS`; with ``cache`` each distinct
    program runs once per task (:class:`CachedCodeReward`). ``fleet`` is a
    :class:`~dew.sandbox.SandboxFleet` (or anything with ``map``); ``all_or_nothing``
    makes a code task score 1.0 only when every case passes (otherwise it scores the
    share of cases passed); the built-in code tasks have one case, so they score 0 or 1 either way.
    ``default`` (``MATH_SOURCE`` or ``CODE_SOURCE``) scores every other data source.
    """
    code = CodeReward(fleet, all_or_nothing=all_or_nothing, argv=CODE_HARNESS)
    math = MathReward()
    return RoutedReward({MATH_SOURCE: math, CODE_SOURCE: CachedCodeReward(code) if cache else code,
                         WORD_SOURCE: LastNumberReward(), GSM8K_SOURCE: GSM8KReward(),
                         **{source: math for source in MATH_SOURCES}}, default=default)


def reward_function(spec: str, cwd: str | Path | None = None) -> FunctionReference:
    """The config's reward ``"module:function"`` or ``"path/to/file.py:function"``, imported once now to name any
    problem (:func:`~dew.recipes.function_reference.function_reference`)."""
    return function_reference(spec, "reward", cwd)
