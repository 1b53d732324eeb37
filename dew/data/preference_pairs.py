"""Preference pairs for DPO: ``PreferencePairs``.

Each record has ``chosen`` and ``rejected`` token-id lists (prompt followed by that
side's answer) and optional ``chosen_mask``/``rejected_mask`` lists of the same length
marking completion tokens with 1 and prompt tokens with 0. A missing mask means every
token is completion; dew never guesses a boundary from text. ``load(batch=B)`` gives

- ``input_ids``: [B, 2, S] int32, index 0 the chosen and 1 the rejected sequence,
  right-padded with ``pad_id``;
- ``completion_mask``: [B, 2, S] int32, 0 on prompt tokens and padding.

``S`` is ``seq_len``, the full row width; a sequence longer than it raises.

With ``tokenizer=`` a record may instead hold text in TRL's standard explicit-prompt
layout, ``prompt``, ``chosen`` and ``rejected`` strings: each side becomes the prompt's ids
followed by the answer's (no special tokens added) and the tokenizer's EOS, if it has one,
with the mask on the answer and EOS. A text pair without a ``prompt`` (TRL's implicit
layout) is refused, since its boundary would have to be guessed.

The conversational form of that layout (TRL's too) holds ``prompt`` as a list of chat messages
and each side as the messages that answer it (usually one assistant message). As TRL's
DPOTrainer does, the prompt is rendered with the generation header and the prompt with each
side's messages without it; the side's ids are what the second render adds (masked 1; the
template closes the turn, so no EOS is added). Where the first render is not a prefix of the
second (a template that renders a prompt differently when an answer follows), TRL trains from
where they diverge; PreferencePairs refuses the row instead, naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from dew.data.loading import Loading, PartitionedLoader, Record, read_records
from dew.data.chat import chat_ids, is_messages
from dew.validation import integer

SIDES = ("chosen", "rejected")


def token_ids(record: Record, field: str, value) -> list[int]:
    """A list of non-negative integer ids (booleans refused), or a RecordError naming the field."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise record.error(field, f"expected a list of token ids, got {type(value).__name__}")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or item < 0:
            raise record.error(field, f"item {position} is {item!r}; token ids are non-negative integers")
    return [int(item) for item in value]


class PreferencePairs(PartitionedLoader):
    """Chosen and rejected sequences with completion masks, from records or a Parquet/JSONL file."""

    owner = "PreferencePairs"

    def __init__(
        self,
        records: Iterable[str | Mapping] | None = None,
        path: str | Path | None = None,
        *,
        seq_len: int,
        pad_id: int = 0,
        loading: Loading | None = None,
        tokenizer=None,
    ):
        integer("PreferencePairs: seq_len", seq_len, at_least=2)
        self.tokenizer = tokenizer
        integer("PreferencePairs: pad_id", pad_id, at_least=0)
        self.seq_len, self.pad_id = seq_len, pad_id
        super().__init__(read_records(records, path, self.owner), loading)

    def encode(self, record: Record) -> dict[str, np.ndarray]:
        ids = np.full((2, self.seq_len), self.pad_id, np.int32)
        mask = np.zeros((2, self.seq_len), np.int32)
        for index, side in enumerate(SIDES):
            if side not in record.fields:
                raise record.error(side, f"missing; a preference pair needs {' and '.join(SIDES)}")
            if isinstance(record.fields[side], str):
                sequence, weights = self.text_side(record, side)
            elif is_messages(record.fields[side]):
                sequence, weights = self.chat_side(record, side)
            else:
                sequence, weights = token_ids(record, side, record.fields[side]), record.fields.get(f"{side}_mask")
            if not sequence:
                raise record.error(side, "is empty")
            if len(sequence) > self.seq_len:
                raise record.error(side, f"has {len(sequence)} ids, more than seq_len={self.seq_len}")
            if weights is None:
                weights = [1] * len(sequence)  # no mask: the whole sequence is completion
            weights = list(weights.tolist() if isinstance(weights, np.ndarray) else weights)
            if len(weights) != len(sequence):
                raise record.error(
                    f"{side}_mask", f"has {len(weights)} entries but {side} has {len(sequence)} ids"
                )
            if any(w not in (0, 1) for w in weights):
                raise record.error(f"{side}_mask", "entries must be 0 (prompt) or 1 (completion)")
            if not any(weights):
                raise record.error(f"{side}_mask", "marks no completion token")
            ids[index, : len(sequence)] = sequence
            mask[index, : len(sequence)] = weights
        return {"input_ids": ids, "completion_mask": mask}

    def text_side(self, record: Record, side: str) -> tuple[list[int], list[int]]:
        """The ids and mask of one text side: prompt ids, then the answer's ids and EOS (masked 1)."""
        if self.tokenizer is None:
            raise record.error(side, "is text, so PreferencePairs needs a tokenizer (tokenizer=...)")
        prompt = record.fields.get("prompt")
        if not isinstance(prompt, str):
            raise record.error("prompt", "a text pair needs a prompt string (TRL's explicit-prompt layout); "
                               "dew never guesses where the prompt ends")
        context = list(self.tokenizer.encode(prompt))
        answer = list(self.tokenizer.encode(record.fields[side], add_special_tokens=False))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        answer += [] if eos is None else [int(eos)]
        return context + answer, [0] * len(context) + [1] * len(answer)

    def chat_side(self, record: Record, side: str) -> tuple[list[int], list[int]]:
        """The ids and mask of one conversational side: the prompt's render with the generation header, then what
        the render of the prompt and this side's messages adds (masked 1)."""
        if self.tokenizer is None:
            raise record.error(side, "holds chat messages, so PreferencePairs needs a tokenizer (tokenizer=...)")
        prompt = record.fields.get("prompt")
        if not is_messages(prompt):
            raise record.error("prompt", "a conversational pair needs the prompt as a non-empty list of chat messages "
                               "(TRL's explicit-prompt layout); dew never guesses where the prompt ends")
        messages = _checked_messages(record, "prompt", prompt) + _checked_messages(record, side, record.fields[side])
        context = chat_ids(self.tokenizer, messages[:len(prompt)], record)
        whole = chat_ids(self.tokenizer, messages, record, field=side, generation=False)
        if whole[:len(context)] != context:
            raise record.error(side, "the chat template renders the prompt differently when this side's messages "
                               "follow it, so where the answer starts would have to be guessed; give token ids with "
                               f"{side}_mask instead")
        if len(whole) == len(context):
            raise record.error(side, "adds nothing to the prompt's render")
        return whole, [0] * len(context) + [1] * (len(whole) - len(context))


def _checked_messages(record: Record, field: str, messages: Sequence[Mapping]) -> list[dict]:
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise record.error(field, f"message {index} has no 'role'")
        if not isinstance(message.get("content"), str):
            raise record.error(field, f"message {index} has no 'content' string")
        out.append(dict(message))
    return out
