"""The rules of a multi-turn episode, for every collector that runs episodes.

:class:`~dew.collection.sources.EnvironmentSource` (one session per thread, each turn one
draw from a RolloutServer) and :class:`~dew.collection.episode_rollout.EpisodeRollout`
(every slot of a batch in lockstep rounds, each round one policy call) schedule their turns
differently; what a turn may do is :class:`EpisodeDriver`'s, the same for both:

- before a model call, :meth:`~EpisodeDriver.limit`: an episode that has made ``max_turns``
  calls, or whose context is longer than ``max_prompt_tokens``, takes no more (it ends
  truncated, its recorded turns whole, and the verifier never runs on it);
- after the call, :meth:`~EpisodeDriver.act`: a response that spent ``max_new_tokens``
  without EOS is recorded with a "truncated" observation and never sent to a tool;
  otherwise the environment's ``step`` gives the next observation, which must be an
  :class:`~dew.records.episode_protocol.Observation` (so must ``reset``'s:
  :meth:`~EpisodeDriver.observed`);
- at the end, with the environment still open, the verifier scores every episode the
  environment completed or truncated (:meth:`~EpisodeDriver.verifiable`), and its result
  must be a finite number (:meth:`~EpisodeDriver.reward`).

The driver raises what the environment raised, unchanged, so each collector reports a
failure its own way: the source as an INFRA_ERROR session, the rollout as an
EpisodeFailure whose cause is the original exception.
"""

from __future__ import annotations

import math
import numbers

from dew.records.episode_protocol import Action, Environment, Episode, EpisodeId, EpisodeStatus, Observation
from dew.validation import positive_int


class NotAnObservation(TypeError):
    """The environment answered ``reset`` or ``step`` with something other than an Observation."""


class EpisodeDriver:
    """What every turn of an episode may do (see the module docstring); the limits are checked when built."""

    def __init__(self, max_prompt_tokens: int, max_new_tokens: int, max_turns: int):
        self.max_prompt_tokens = positive_int("max_prompt_tokens", max_prompt_tokens)
        self.max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
        self.max_turns = positive_int("max_turns", max_turns)

    def limit(self, episode: Episode, calls: int) -> str | None:
        """Why a running episode that has made ``calls`` model calls takes no more; None while it may."""
        if calls >= self.max_turns:
            return f"the episode needs more than max_turns={self.max_turns} model calls"
        context = episode.last.context
        if len(context) > self.max_prompt_tokens:
            return f"a context of {len(context)} ids exceeds max_prompt_tokens={self.max_prompt_tokens}"
        return None

    def act(self, env: Environment, action: Action, identity: EpisodeId) -> Observation:
        """The observation ``action`` leads to; a response without EOS never reaches the tool."""
        if not action.eos:
            return Observation((), EpisodeStatus.TRUNCATED,
                               f"the response spent max_new_tokens={self.max_new_tokens} without EOS")
        return self.observed(env.step(action), identity)

    @staticmethod
    def observed(observation, identity: EpisodeId) -> Observation:
        """``observation``, checked to be one (NotAnObservation names the episode otherwise)."""
        if not isinstance(observation, Observation):
            raise NotAnObservation(f"the environment of {identity} returned {type(observation).__name__}, "
                                   "not an Observation")
        return observation

    @staticmethod
    def verifiable(episode: Episode) -> bool:
        """Whether the verifier scores ``episode``: the environment completed or truncated it (a host limit's
        truncation is the collector's to know: those episodes are never verified)."""
        return episode.status in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED)

    @staticmethod
    def reward(value, where: str) -> float:
        """The verifier's result as a float; ValueError naming ``where`` unless it is a finite real number."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"the verifier returned {value!r} for {where}; a finite number is needed")
        return float(value)
