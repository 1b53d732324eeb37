"""A model judge as the reward: each finished response scored by another model's reply.

``JudgeReward(server, tokenizer, template, parse, ...)`` is a reward with the Prompts
signature (plus ``prompt=``, which :func:`~dew.collection.scoring.score_completion` passes
because ``reads_prompt`` is true). For each response it fills ``template``'s
``{prompt}``, ``{response}``, ``{ground_truth}``, ``{data_source}`` and ``{extra_info}``,
renders the text as one user message through the judge tokenizer's chat template (with the
generation prompt; ``chat=False`` or a tokenizer without one: the text as it is), draws the
judge's reply greedily from ``server`` (any :class:`~dew.inference.RolloutServer`: the RLVR
pipeline's judge servers are RolloutServerActors of their own, never pushed to) and turns
the reply into a number with ``parse`` (:func:`first_number` by default).

A reply that does not parse, a draw that fails, or a judge prompt longer than
``max_length`` raises :class:`JudgeError`: the source makes that response an INFRA_ERROR,
drawn again, never a zero reward. PromptSource scores each draw on its scoring threads as
the draw finishes, so judging overlaps the policy's generation.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable

from dew.collection.scoring import ScoringError

JUDGE_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {ground_truth}\n\nResponse:\n{response}\n\n"
                  "Is the response correct? Reply with 1 if it is and 0 if it is not.")
FIELDS = ("prompt", "response", "ground_truth", "data_source", "extra_info")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(ScoringError):
    """The judge could not score a response (its reply held no number, its draw failed, its prompt was too long)."""


def check_template(template: str, field: str = "judge_template") -> str:
    """``template``, checked to name ``{response}`` and no placeholder but :data:`FIELDS`."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as error:
        raise ValueError(f"config field {field!r} is not a format string: {error}") from None
    unknown = sorted(names - set(FIELDS))
    if unknown or "response" not in names:
        raise ValueError(f"config field {field!r} must name {{response}} and only {', '.join(f'{{{f}}}' for f in FIELDS)}"
                         f"; it names {sorted(names)}")
    return template


def first_number(reply: str) -> float:
    """The first number written in the judge's reply ("Score: 0.8" reads 0.8); JudgeError when there is none."""
    found = NUMBER.search(reply)
    if found is None:
        raise JudgeError(f"the judge's reply {reply[:200]!r} holds no number")
    return float(found.group())


class JudgeReward:
    """The reward of a judge model (see the module docstring)."""

    reads_prompt = True

    def __init__(self, server, tokenizer, template: str = JUDGE_TEMPLATE, parse: Callable[[str], float] = first_number,
                 max_new_tokens: int = 16, max_length: int = 1024, eos_ids=(), chat: bool = True,
                 timeout: float | None = 600.0):
        self.server, self.tokenizer, self.template = server, tokenizer, check_template(template)
        self.parse, self.max_new_tokens, self.max_length = parse, max_new_tokens, max_length
        self.eos_ids = frozenset(int(i) for i in eos_ids) or frozenset({int(tokenizer.eos_token_id)})
        self.chat = chat and getattr(tokenizer, "chat_template", None) is not None
        self.timeout = timeout

    def prompt_ids(self, **fields: str) -> list[int]:
        """The judge's input ids for one response's fields."""
        text = self.template.format(**{name: fields.get(name, "") for name in FIELDS})
        if self.chat:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=False))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str, prompt: str = "") -> float:
        ids = self.prompt_ids(prompt=prompt, response=completion, ground_truth=ground_truth, data_source=data_source,
                              extra_info=extra_info)
        if len(ids) + self.max_new_tokens > self.max_length:
            raise JudgeError(f"the judge's prompt ({len(ids)} ids) and reply ({self.max_new_tokens}) exceed "
                             f"judge_max_length={self.max_length}")
        try:
            drawn = self.server.submit(ids, self.max_new_tokens, seed=0).result(timeout=self.timeout).ids
        except Exception as error:
            raise JudgeError(f"the judge's draw failed: {error!r}") from error
        reply = self.tokenizer.decode([i for i in drawn if i not in self.eos_ids], skip_special_tokens=True)
        return self.parse(reply)

    def __repr__(self) -> str:
        return f"JudgeReward({self.server!r})"
