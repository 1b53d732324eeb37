"""The one path from a finished draw to a score: strip EOS, decode, call the reward, check the number.

Every single-turn collector scores through :func:`score_completion`: SampledRollout (the
native generator inside the trainer), PromptSource (draws from any RolloutServer) and the
held-out measurement of the RLVR recipe. The reward has the Prompts signature

    reward(data_source: str, completion: str, ground_truth: str, extra_info: str) -> float

and its string fields are read by name from a mapping (a Task's data, a prompt row's
metadata). A reward whose ``reads_prompt`` attribute is true (a model judge) is also given
``prompt=``, the decoded ``prompt_ids`` of that mapping. A failure raises :class:`ScoringError` saying which stage failed (decode, the
reward, or what it returned); the caller adds where (a prompt row, a session) or turns it
into an INFRA_ERROR session.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

REWARD_FIELDS = ("data_source", "ground_truth", "extra_info")


class ScoringError(ValueError):
    """A completion could not be scored: decoding failed, the reward raised, or it returned no finite number."""


def finite_score(name: str, value) -> float:
    """A reward or verifier result as a float, or a ValueError saying what came back instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
        raise ScoringError(f"the {name} returned {value!r}; it must return a finite float")
    return float(value)


def token_text(ids: Sequence[int]) -> str:
    """The default decode: ids separated by spaces."""
    return " ".join(str(int(i)) for i in ids)


def completion_ids(ids: Sequence[int], eos_ids: Collection[int]) -> list[int]:
    """The sampled ids the reward reads: a final EOS id left out."""
    ids = [int(i) for i in ids]
    return ids[:-1] if ids and ids[-1] in eos_ids else ids


def score_completion(reward: Callable[[str, str, str, str], float], decode: Callable[[list[int]], str],
                     ids: Sequence[int], eos_ids: Collection[int], fields: Mapping[str, str]) -> float:
    """Score one draw's ``ids`` against the reward ``fields`` (data_source, ground_truth, extra_info; a missing
    one reads as the empty string)."""
    try:
        completion = decode(completion_ids(ids, eos_ids))
    except Exception as error:
        raise ScoringError(f"decode failed: {error!r}") from error
    data_source, ground_truth, extra_info = (str(fields.get(name, "")) for name in REWARD_FIELDS)
    extra = {}
    if getattr(reward, "reads_prompt", False):
        try:
            extra["prompt"] = decode([int(i) for i in fields["prompt_ids"]])
        except Exception as error:
            raise ScoringError(f"decoding the prompt for the reward failed: {error!r}") from error
    try:
        value = reward(data_source, completion, ground_truth, extra_info, **extra)
    except Exception as error:
        raise ScoringError(f"the reward raised {error!r}") from error
    return finite_score("reward", value)
