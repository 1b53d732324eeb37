"""What an RL run trains, read from its config's files: the policy and its tokenizer, and the prompt rows.

- :func:`load_policy`: a Hugging Face model directory (any architecture
  :class:`~dew.models.pretrained.Pretrained` reads: Llama, Qwen2, Qwen3) as a :class:`Policy`,
  the decoder computing in ``dtype`` over float32 master weights, with its tokenizer (the
  directory's, or another directory's);
- :func:`read_prompt_rows`: verl-layout rows (``data_source``, ``prompt``,
  ``reward_model.ground_truth``, ``extra_info``) from Parquet, JSON lines or a directory
  ``datasets`` wrote with ``save_to_disk``, every row checked, a missing column named with
  its row;
- :func:`fit_prompts`: each row's prompt ids as :class:`~dew.data.Prompts` encodes them
  (chat messages through the tokenizer's chat template with the generation prompt, and
  ``enable_thinking`` for templates that read it), and verl's ``filter_overlong_prompts``:
  rows longer than ``max_prompt_length`` are left out and counted.

Every failure names the file, the row or the field, before any work starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp

from dew.data.loading import read_file
from dew.data.prompts import Prompts
from dew.models.pretrained import Pretrained

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REQUIRED_COLUMNS = ("data_source", "prompt")


@dataclasses.dataclass
class Policy:
    """A model to train: the flax module, its variables (None until warm-started), tokenizer and Hugging Face form."""

    model: object
    params: object | None
    tokenizer: object
    pretrained: Pretrained
    source: str  # where it came from, for the run's first lines


def load_tokenizer(directory: str | Path, field: str = "tokenizer"):
    """The ``AutoTokenizer`` of a local directory, or a named error."""
    from transformers import AutoTokenizer  # slow to import; only runs on a user's model need it

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as error:  # transformers raises many types for a directory without tokenizer files
        raise ValueError(f"config field {field!r}: cannot load a tokenizer from {directory} "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:300]})") from None


def model_tokenizer(model: str | Path, tokenizer: str | Path | None = None, field: str = "model"):
    """The tokenizer of the model directory (config field ``field``), or of ``tokenizer`` when given."""
    return load_tokenizer(tokenizer or model, "tokenizer" if tokenizer else field)


def load_policy(model: str | Path, tokenizer: str | Path | None = None, dtype: str = "float32",
                field: str = "model") -> Policy:
    """The Hugging Face model directory ``model`` (config field ``field``) as a Policy (see the module docstring)."""
    directory = Path(model).expanduser()
    if not directory.is_dir():
        raise ValueError(f"config field {field!r}: {directory} is not a directory (a Hugging Face model directory "
                         "with config.json, safetensors and tokenizer files)")
    if dtype not in DTYPES:
        raise ValueError(f"config field 'dtype' must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        pretrained = Pretrained.from_directory(directory)
        built = pretrained.model(dtype=DTYPES[dtype], param_dtype=jnp.float32)  # float32 master weights
        params = pretrained.load()
    except (FileNotFoundError, KeyError, ValueError) as error:
        raise ValueError(f"config field {field!r}: {error}") from None
    words = model_tokenizer(directory, tokenizer, field)
    if len(words) > built.vocab_size:
        raise ValueError(f"config field 'tokenizer': its {len(words)} ids do not fit the model's vocab_size "
                         f"{built.vocab_size} ({directory / 'config.json'})")
    if words.eos_token_id is None:
        raise ValueError(f"config field 'tokenizer': the tokenizer of {tokenizer or directory} has no EOS token, "
                         "so no completion could end")
    return Policy(built, params, words, pretrained, f"{pretrained.architecture} from {directory}")


def read_prompt_rows(path: str | Path, field: str = "prompts") -> list[dict]:
    """The verl-layout rows of a prompts file or saved dataset directory, each checked (see the module docstring)."""
    path = Path(path).expanduser()
    try:
        records = read_file(path, f"config field {field!r}")
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None
    if not records:
        raise ValueError(f"config field {field!r}: {path} holds no rows")
    rows = []
    for record in records:
        row = dict(record.fields)
        for name in REQUIRED_COLUMNS:
            if name not in row:
                raise ValueError(f"config field {field!r}: {path} row {record.row} has no {name!r} column "
                                 f"(it has {sorted(row)})")
        truth = row.get("reward_model")
        if not isinstance(truth, Mapping) or "ground_truth" not in truth:
            raise ValueError(f"config field {field!r}: {path} row {record.row} has no reward_model.ground_truth "
                             "(verl's layout: reward_model = {\"ground_truth\": ...})")
        rows.append(row)
    return rows


@dataclasses.dataclass
class FittedPrompts:
    """The rows kept, each one's prompt ids, and how many rows were longer than the prompt budget."""

    rows: list[dict]
    ids: list[list[int]]
    filtered: int

    @property
    def longest(self) -> int:
        return max(len(ids) for ids in self.ids)


def prompt_encoder(rows: Sequence[dict], tokenizer, enable_thinking: bool | None = None) -> Prompts:
    """The Prompts that encodes ``rows`` as the run does (the template options included)."""
    options = {}
    if enable_thinking is not None:
        template = getattr(tokenizer, "chat_template", None) or ""
        if "enable_thinking" not in template:
            raise ValueError("config field 'enable_thinking' is set but the tokenizer's chat template has no "
                             "enable_thinking switch (Qwen3's has one)")
        options["enable_thinking"] = enable_thinking
    return Prompts(records=list(rows), tokenizer=tokenizer, max_prompt_len=1, template_options=options)


def fit_prompts(rows: Sequence[dict], tokenizer, max_prompt_length: int | None, field: str = "prompts",
                enable_thinking: bool | None = None) -> FittedPrompts:
    """Encode every row's prompt; rows longer than ``max_prompt_length`` (None: no bound) are left out, counted.

    Leaving the rows out is verl's ``data.filter_overlong_prompts``. A file whose every row is too
    long is refused, naming the longest and shortest prompt.
    """
    encoder = prompt_encoder(rows, tokenizer, enable_thinking)
    try:
        encoded = [encoder.prompt_ids(record) for record in encoder.records]
    except ValueError as error:
        raise ValueError(f"config field {field!r}: {error}") from None
    kept = [(row, ids) for row, ids in zip(rows, encoded) if max_prompt_length is None or len(ids) <= max_prompt_length]
    if not kept:
        lengths = sorted(len(ids) for ids in encoded)
        raise ValueError(f"config field 'max_prompt_length' ({max_prompt_length}) is shorter than every prompt of "
                         f"{field!r} (they run from {lengths[0]} to {lengths[-1]} ids): no row is left to train on")
    return FittedPrompts([row for row, _ in kept], [ids for _, ids in kept], len(rows) - len(kept))
