"""Conversations for SFT: token roles (``Role``) and the ``ChatMessages`` loader.

Each token of a chat row carries the role of the message it came from, stored as a
small integer (``np.int8``) in the ``text_roles`` column. ``LMObjective(loss_role=...)``
counts only targets of one role, usually ``Role.ASSISTANT``.

``ChatMessages`` renders each conversation with the tokenizer's chat template one
prefix at a time: the ids a message adds to the render of the messages before it get
that message's role. Before an assistant message the template's generation header
(``add_generation_prompt``) is rendered on its own and gets ``Role.HEADER``, so the
assistant span starts after it. Every prefix's render must be the start of the longer
render and end on a boundary between two of its tokens (the full render is tokenized
once, and the tokens' character offsets place each boundary); a template that
rewrites earlier tokens (Qwen3's original template drops earlier reasoning, for
example) raises, and so does a render that ends inside a token, because no per-token
role would be right for either. This check does not prove the masks right for every
template: look at ``render(messages)`` for typical conversations before a real run.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.dataset import Dataset, Partition, local_partition
from dew.data.loading import (
    SAVED_DATASET_MARKERS,
    Loading,
    PartitionedLoader,
    Record,
    RecordError,
    RecordStream,
    local_rows,
    read_file,
    read_saved_dataset,
)
from dew.data.document_packing import pack_documents
from dew.validation import positive_int


class Role(enum.IntEnum):
    """The role value of a token. ``PAD`` marks padding, which never counts as a target.

    ``HEADER`` marks the template tokens that open an assistant turn (the generation
    prompt, such as ``<|im_start|>assistant\\n``): the model sees them as context, and
    an assistant-only loss does not train on them.
    """

    PAD = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4
    HEADER = 5


MESSAGE_ROLES = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT, "tool": Role.TOOL}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFOptions:
    """What ChatMessages passes to ``datasets.load_dataset`` for a Hub dataset id."""

    name: str | None = None
    data_dir: str | None = None
    data_files: Any = None
    revision: str | None = None
    cache_dir: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        fields = {"name": self.name, "data_dir": self.data_dir, "data_files": self.data_files,
                  "revision": self.revision, "cache_dir": self.cache_dir}
        return {**{k: v for k, v in fields.items() if v is not None}, **self.extra}


def load_tokenizer(tokenizer):
    """A tokenizer object, or one loaded with ``AutoTokenizer`` from a Hub name or local path."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} has no chat template; "
            "ChatMessages needs one to turn messages into tokens (set tokenizer.chat_template)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} is not a fast "
            "(Rust tokenizers) one; ChatMessages gives tokens roles from their character offsets, which only fast "
            "tokenizers report"
        )
    return tokenizer


class ChatMessages(PartitionedLoader):
    """Conversations from Parquet, JSON lines or a Hugging Face dataset, packed for LMObjective.

    tokenizer: a tokenizer with a chat template, or a Hub name or local path for AutoTokenizer.
    path: a ``.parquet``/``.jsonl``/``.json`` file, a ``datasets`` directory saved with
    ``save_to_disk``, a ``datasets.Dataset``/``DatasetDict``, or a Hub dataset id.
    seq_len: L, the predicted positions; each row holds ``L + 1`` ids.
    column: the messages column (default ``messages``); a row without it but with a
    ``prompt`` column (verl's layout) is read from ``prompt``. A ``tools`` column
    (a list of schemas or its JSON text) is passed to the template.
    split, options: the split and :class:`HFOptions` for a Hub dataset.
    val_path: conversations for validation, read the same way.
    """

    owner = "ChatMessages"

    def __init__(
        self,
        tokenizer,
        path,
        seq_len: int,
        column: str = "messages",
        split: str = "train",
        options: HFOptions | None = None,
        val_path=None,
        loading: Loading | None = None,
    ):
        positive_int("ChatMessages: seq_len", seq_len)
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_len, self.column, self.split = seq_len, column, split
        self.options = options or HFOptions()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        super().__init__(read_conversations(path, split, self.options), loading)
        self.val_records = None if val_path is None else read_conversations(val_path, split, self.options)

    # ----- rendering -----------------------------------------------------------------------

    def messages_of(self, record: Record) -> tuple[list[dict], list | None]:
        fields = record.fields
        column = self.column if self.column in fields else "prompt" if "prompt" in fields else None
        if column is None or fields[column] is None:
            raise record.error(self.column, "missing (and no 'prompt' column in verl's layout)")
        messages = fields[column]
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError:
                raise record.error(column, "is a string that is not JSON messages") from None
        if not isinstance(messages, (list, tuple)) or not messages:
            raise record.error(column, "must be a non-empty list of messages")
        out = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise record.error(column, f"message {index} is a {type(message).__name__}, not a mapping")
            if "role" not in message or message["role"] is None:
                raise record.error(column, f"message {index} has no 'role'")
            if message["role"] not in MESSAGE_ROLES:
                raise record.error(
                    column, f"message {index} has role {message['role']!r}; the roles are {sorted(MESSAGE_ROLES)}"
                )
            out.append({key: value for key, value in message.items() if value is not None})
        if out[0]["role"] not in ("system", "user"):
            raise record.error(column, f"starts with a {out[0]['role']} message; conversations start with system or user")
        tools = fields.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools) if tools else None
            except json.JSONDecodeError:
                raise record.error("tools", "is a string that is not JSON tool schemas") from None
        return out, tools or None

    def _text(self, messages, tools, generation: bool, record: Record, index: int) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation
            )
        except Exception as error:  # a template's own checks raise many types
            raise record.error(self.column, f"the chat template refused message {index} ({error})") from None

    def _texts(self, prefixes: list[tuple[int, bool]], messages, tools, record: Record) -> list[str]:
        """The renders of ``messages[:end]`` (with the generation header where asked), in order.

        Two calls of transformers' renderer (one per ``add_generation_prompt`` value) take
        every prefix, with what ``apply_chat_template`` gives the template (the special
        tokens' names): one call per prefix costs more than the render itself. A template
        that refuses a prefix is rendered again one prefix at a time to name the message.
        """
        from transformers.utils.chat_template_utils import render_jinja_template  # slow to import; chat loading only

        template = self.tokenizer.get_chat_template(None, tools)
        names = self.tokenizer.special_tokens_map
        texts: list[str | None] = [None] * len(prefixes)
        for generation in (False, True):
            where = [k for k, (_, asked) in enumerate(prefixes) if asked == generation]
            if not where:
                continue
            try:
                rendered, _ = render_jinja_template([messages[: prefixes[k][0]] for k in where], tools=tools,
                                                    chat_template=template, add_generation_prompt=generation, **names)
            except Exception:  # a template's own checks raise many types; find the message it refused
                for end, asked in prefixes:
                    self._text(messages[:end], tools, asked, record, end - 1 if not asked else end)
                raise
            for k, text in zip(where, rendered, strict=True):
                texts[k] = text
        return texts

    def _renders(self, messages: Sequence[Mapping], tools, record: Record) -> tuple[list[str], list[tuple[Role, str]]]:
        """Each prefix's render with the role of what it adds, checked to extend the render before it."""
        prefixes: list[tuple[int, bool]] = []  # (messages rendered, with the generation header)
        labels: list[tuple[Role, str]] = []
        for index, message in enumerate(messages):
            role = MESSAGE_ROLES[message["role"]]
            if role == Role.ASSISTANT:
                prefixes.append((index, True))
                labels.append((Role.HEADER, "the generation header"))
            elif index + 1 < len(messages) and messages[index + 1]["role"] == message["role"]:
                # A run of same-role messages (consecutive tool results) is one turn: templates close
                # the turn only after its last message, so the prefix is taken at the end of the run.
                continue
            prefixes.append((index + 1, False))
            labels.append((role, f"message {index}"))
        texts = self._texts(prefixes, list(messages), tools, record)
        for earlier, text, (_, what) in zip(texts, texts[1:], labels[1:]):
            if not text.startswith(earlier):
                at = next((i for i, (a, b) in enumerate(zip(earlier, text)) if a != b), min(len(earlier), len(text)))
                raise record.error(
                    self.column,
                    f"the chat template changes earlier tokens when it renders {what} (its text differs from the "
                    f"render before at character {at}: {earlier[at : at + 20]!r} became {text[at : at + 20]!r}); "
                    "per-token roles need a template whose renders extend each other",
                )
        return texts, labels

    def _roles(self, texts: list[str], labels, offsets: Sequence[tuple[int, int]], record: Record) -> list[int]:
        """The role of each token of the full render, whose character spans are ``offsets``."""
        ends = [end for _, end in offsets]
        roles: list[int] = []
        for text, (role, what) in zip(texts, labels):
            count = bisect.bisect_right(ends, len(text))
            if count < len(offsets) and offsets[count][0] < len(text):
                start, end = offsets[count]
                raise record.error(
                    self.column,
                    f"the render of {what} ends at character {len(text)}, inside token {count} "
                    f"({texts[-1][start:end]!r}) of the longer render, so that token would have two roles; "
                    "per-token roles need renders that end on token boundaries",
                )
            roles += [role] * (count - len(roles))
        return roles

    def render(self, messages: Sequence[Mapping], tools: Sequence | None = None, record: Record | None = None):
        """Token ids and roles ``(list[int], list[Role])`` of one conversation.

        Renders every prefix that ends a turn (and, before each assistant message, the
        prefix with the generation header), checks that each render is the start of the
        next, tokenizes the full render once and gives the ids each render adds to the
        role of the message (or ``Role.HEADER``). A render that ends inside a token of
        the full render raises, since that token would belong to two messages.
        """
        record = record or Record("messages", 0, {})
        return self._tokenized([self._renders(messages, tools, record)], [record])[0]

    def _tokenized(self, rendered, records: Sequence[Record]) -> list[tuple[list[int], list[int]]]:
        """Ids and roles of each conversation's full render; one tokenizer call takes them all."""
        encodings = self.tokenizer([texts[-1] for texts, _ in rendered], add_special_tokens=False,
                                   return_offsets_mapping=True)
        return [(list(ids), self._roles(texts, labels, offsets, record)) for (texts, labels), ids, offsets, record
                in zip(rendered, encodings["input_ids"], encodings["offset_mapping"], records, strict=True)]

    def encode_many(self, records: Sequence[Record]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(ids, roles)`` arrays of each record."""
        rendered = [self._renders(*self.messages_of(record), record) for record in records]
        out = []
        for record, (ids, roles) in zip(records, self._tokenized(rendered, records), strict=True):
            if len(ids) > self.seq_len + 1:
                raise record.error(
                    self.column, f"renders to {len(ids)} tokens, more than seq_len + 1 = {self.seq_len + 1}"
                )
            out.append((np.asarray(ids, np.int32), np.asarray(roles, np.int8)))
        return out

    def encode(self, record: Record) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_many([record])[0]

    # ----- packing -------------------------------------------------------------------------

    def collate(self, encoded: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        """Conversations packed in order into rows of ``seq_len + 1`` ids."""
        return pack_documents([ids for ids, _ in encoded], self.seq_len + 1, self.pad_id, [r for _, r in encoded])

    def load(self, batch: int) -> Dataset:
        """Packed ``text``, ``text_roles``, ``text_segment_ids``, ``text_positions`` batches, each [B, L + 1]."""
        here = local_partition()
        row_count = len(self.columns(here)["text"])
        val_rows = None
        if self.val_records is not None:
            val_rows = self.collate(self.loading.encode(self.val_records, self.encode_many))

        def train(partition: Partition) -> RecordStream:
            columns = self.columns(partition)
            rows = local_rows(batch, partition, self.owner)
            # Packing is per process, so each process's epoch has as many batches as its own rows fill.
            per_epoch = len(columns["text"]) // rows
            if per_epoch == 0:
                raise ValueError(
                    f"ChatMessages.load: process {partition.index} packs {len(columns['text'])} rows, "
                    f"fewer than its {rows} rows of a batch"
                )
            return RecordStream(columns, rows, per_epoch, self.loading)

        def val(partition: Partition):
            rows = local_rows(batch, partition, self.owner)
            count = len(val_rows["text"]) // batch
            if count == 0:
                raise ValueError(f"ChatMessages: val_path packs into {len(val_rows['text'])} rows, fewer than a batch of {batch}")
            for index in range(count):
                start = index * batch + partition.index * rows
                yield {name: column[start : start + rows] for name, column in val_rows.items()}

        train(here)  # a batch the packed rows cannot fill raises now, not in the trainer
        return Dataset(train=train, val=None if val_rows is None else val, records=row_count, batch=batch)


def is_messages(value) -> bool:
    """A non-empty list whose items are mappings: chat messages, not token ids."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(item, Mapping) for item in value)


def chat_ids(tokenizer, messages: list[dict], record: Record, options: Mapping | None = None, field: str = "prompt",
             generation: bool = True) -> list[int]:
    """The ids of ``messages`` rendered by the tokenizer's chat template (with the generation header unless
    ``generation`` is False); errors name ``field`` of ``record``."""
    if not getattr(tokenizer, "chat_template", None):
        raise record.error(field, "holds messages but the tokenizer has no chat template")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True,
                                                 **(options or {}))
    except Exception as error:  # a template's own checks raise many types
        raise record.error(field, f"the chat template refused these messages ({error})") from None
    if isinstance(rendered, Mapping):  # transformers may return a BatchEncoding
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]


def read_conversations(path, split: str, options: HFOptions) -> list[Record]:
    """Rows of a conversation source as Records (see ChatMessages for what ``path`` may be)."""
    by_name = isinstance(path, (str, Path))  # a file, a saved directory or a dataset id
    if by_name and Path(path).suffix in (".parquet", ".jsonl", ".json"):
        return read_file(Path(path), "ChatMessages")
    import datasets

    source = str(path) if by_name else type(path).__name__
    if by_name and any((Path(path) / marker).exists() for marker in SAVED_DATASET_MARKERS):
        return read_saved_dataset(Path(path), split, "ChatMessages")
    if by_name:
        try:
            path = datasets.load_dataset(str(path), split=split, **options.kwargs())
        except Exception as error:  # datasets raises many types for a missing or unreachable dataset
            raise ValueError(f"ChatMessages: cannot load dataset {source!r} split {split!r} ({error})") from None
    if isinstance(path, datasets.DatasetDict):
        if split not in path:
            raise ValueError(f"ChatMessages: {source} has splits {sorted(path)}, not {split!r}")
        path = path[split]
    if not isinstance(path, datasets.Dataset):
        raise TypeError(f"ChatMessages: path must be a file, a datasets directory or id, or a datasets.Dataset; got {source}")
    return [Record(source, row, item) for row, item in enumerate(path)]


__all__ = ["ChatMessages", "HFOptions", "Role", "RecordError"]
