"""Prompt rows for GRPO: ``Prompts``.

Each record has ``prompt`` and the reward metadata ``data_source``, ``ground_truth`` and
``extra_info``. The prompt is a list of token ids, a string, or a list of
``{"role", "content"}`` messages; strings and messages need a tokenizer (messages are
rendered with its chat template and the generation header), token-id lists load none.
verl's parquet layout is read as verl writes it: ``reward_model.ground_truth`` is the
ground truth, ``extra_info`` (with its ``tools_kwargs``) travels whole, and ``ability``
and ``agent_name`` are read and dropped. A missing reward field becomes an empty
string; metadata that is not a string travels as JSON text.

``load(batch=B)`` yields

- ``prompt``: [B, P] int32, left-padded with ``pad_id``; a longer prompt keeps its end;
- ``prompt_length``: [B] int32, the real ids in each row;
- ``data_source``, ``ground_truth``, ``extra_info``: [B, W] int32 UTF-8 byte values,
  zero-padded on the right, ``W`` the longest value of that field over all records.

``SampledRollout`` turns the byte columns back into strings for the reward.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from dew.data.chat import chat_ids, is_messages
from dew.data.loading import Loading, PartitionedLoader, Record, read_records
from dew.data.preference_pairs import token_ids
from dew.validation import positive_int

METADATA = ("data_source", "ground_truth", "extra_info")
DROPPED = ("ability", "agent_name")  # verl columns with no place in a prompt batch


def metadata_text(record: Record, field: str) -> str:
    """A reward field as text: strings as they are, anything else as JSON, missing as ''."""
    fields = record.fields
    if field == "ground_truth" and "ground_truth" not in fields and isinstance(fields.get("reward_model"), Mapping):
        value = fields["reward_model"].get("ground_truth")
    else:
        value = fields.get(field)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=_json_default)
    except TypeError as error:
        raise record.error(field, f"cannot be written as JSON text ({error})") from None


def _json_default(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def utf8_column(texts: list[str]) -> np.ndarray:
    """Strings as a [rows, longest] int32 array of UTF-8 byte values, zero-padded."""
    encoded = [text.encode("utf-8") for text in texts]
    width = max((len(b) for b in encoded), default=0)
    out = np.zeros((len(encoded), width), np.int32)
    for row, data in enumerate(encoded):
        out[row, : len(data)] = np.frombuffer(data, np.uint8)
    return out


def utf8_text(row: np.ndarray) -> str:
    """The inverse of one row of :func:`utf8_column`."""
    data = np.asarray(row).astype(np.uint8).tobytes()
    return data.rstrip(b"\x00").decode("utf-8")


def prompt_rows(batch: Mapping[str, np.ndarray], owner: str) -> list[list[int]]:
    """The real ids of each row of a Prompts batch (``prompt`` left-padded, ``prompt_length``)."""
    for field in ("prompt", "prompt_length"):
        if field not in batch:
            raise KeyError(f"{owner} needs a Prompts batch with {field!r}; the batch has {sorted(batch)}")
    prompt = np.asarray(batch["prompt"])
    lengths = np.asarray(batch["prompt_length"])
    if prompt.ndim != 2 or lengths.shape != prompt.shape[:1]:
        raise ValueError(f"prompt must be [B, P] with prompt_length [B], got {prompt.shape} and {lengths.shape}")
    rows = []
    for row, length in enumerate(int(n) for n in lengths):
        if not 0 < length <= prompt.shape[1]:
            raise ValueError(f"prompt_length {length} of row {row} must lie in [1, {prompt.shape[1]}]")
        rows.append([int(i) for i in prompt[row, prompt.shape[1] - length:]])
    return rows


def metadata_texts(batch: Mapping[str, np.ndarray], field: str, rows: int) -> list[str]:
    """A reward field of a Prompts batch as one string per row ('' for every row when absent)."""
    if field not in batch:
        return [""] * rows
    values = np.asarray(batch[field])
    if values.ndim != 2 or values.shape[0] != rows:
        raise ValueError(f"{field} must be a [B, W] UTF-8 byte column with B={rows}, got shape {values.shape}")
    texts = []
    for row in range(rows):
        try:
            texts.append(utf8_text(values[row]))
        except (UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"prompt row {row}: {field} is not valid UTF-8 bytes ({error})") from error
    return texts


class Prompts(PartitionedLoader):
    """Prompts with reward metadata, from records or a Parquet/JSONL file (verl's layout included)."""

    owner = "Prompts"

    def __init__(
        self,
        records: Iterable[str | Mapping] | None = None,
        path: str | Path | None = None,
        *,
        tokenizer=None,
        max_prompt_len: int,
        pad_id: int | None = None,
        loading: Loading | None = None,
        template_options: Mapping | None = None,
    ):
        positive_int("Prompts: max_prompt_len", max_prompt_len)
        self.template_options = dict(template_options or {})  # extra chat-template variables (enable_thinking)
        super().__init__(read_records(records, path, self.owner), loading)
        self.max_prompt_len = max_prompt_len
        self._tokenizer = None if isinstance(tokenizer, (str, Path)) else tokenizer
        needs_tokenizer = next((r for r in self.records if not _is_id_list(r.fields.get("prompt"))), None)
        if needs_tokenizer is not None and tokenizer is None:
            kind = type(needs_tokenizer.fields.get("prompt")).__name__
            raise needs_tokenizer.error(
                "prompt", f"is a {kind}, not a list of token ids, so Prompts needs a tokenizer (tokenizer=...)"
            )
        if needs_tokenizer is not None and self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        if pad_id is None:
            pad_id = getattr(self._tokenizer, "pad_token_id", None) or 0
        self.pad_id = int(pad_id)
        # Widths over every record, not this process's share, so all processes agree on shapes.
        self._metadata = {
            field: utf8_column([metadata_text(r, field) for r in self.records]) for field in METADATA
        }
        self._index = {(r.source, r.row): index for index, r in enumerate(self.records)}

    @property
    def tokenizer(self):
        return self._tokenizer

    def prompt_ids(self, record: Record) -> list[int]:
        if "prompt" not in record.fields:
            raise record.error("prompt", "missing")
        prompt = record.fields["prompt"]
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if _is_id_list(prompt):
            ids = token_ids(record, "prompt", prompt)
        elif isinstance(prompt, str):
            ids = list(self._tokenizer.encode(prompt, add_special_tokens=False))
        elif is_messages(prompt):
            for index, message in enumerate(prompt):
                for key in ("role", "content"):
                    if key not in message:
                        raise record.error("prompt", f"message {index} has no {key!r}")
            ids = chat_ids(self._tokenizer, [dict(m) for m in prompt], record, self.template_options)
        else:
            raise record.error("prompt", "must be token ids, a string or a list of role/content messages")
        if not ids:
            raise record.error("prompt", "is empty")
        return ids

    def encode(self, record: Record) -> dict[str, np.ndarray]:
        ids = self.prompt_ids(record)[-self.max_prompt_len :]  # a long prompt keeps its end
        prompt = np.full(self.max_prompt_len, self.pad_id, np.int32)
        prompt[self.max_prompt_len - len(ids) :] = ids
        out = {"prompt": prompt, "prompt_length": np.int32(len(ids))}
        index = self._index[(record.source, record.row)]
        for field in METADATA:
            out[field] = self._metadata[field][index]
        return out


def _is_id_list(value) -> bool:
    if isinstance(value, np.ndarray):
        return np.issubdtype(value.dtype, np.integer)
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(item, (int, np.integer)) and not isinstance(item, bool) for item in value
    )
