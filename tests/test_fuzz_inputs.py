"""Fuzzed bad input (hypothesis): loader records and run configs.

Each generated input either works or raises a named error (a RecordError naming the row
and field, a ConfigError naming the field); nothing else escapes, and a valid input
afterwards still works, so a refused input left no state behind. The examples are
derandomized so CI sees the same inputs every run; ``HYPOTHESIS_PROFILE=explore`` draws
ten times as many, at random.
"""

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dew.config import ConfigError, load_config
from dew.data.chat import ChatMessages
from dew.data.dataset import Partition
from dew.data.loading import RecordError
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.data.stories import story_tokenizer
from dew_ray.pipelines.chain import ChainConfig
from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig

settings.register_profile("dew", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", max_examples=600, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "dew"))
TOKENIZER = story_tokenizer()
LOADERS = ("PreferencePairs", "Prompts", "ChatMessages")

# any JSON value, small: what a file's row or a hand-written record could hold
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ids = st.lists(st.integers(0, 40), min_size=1, max_size=12) | st.lists(st.integers(-3, 40) | json_values, max_size=4)
texts = st.text(max_size=40)


def records_of(fields: dict):
    """Records built from ``fields`` (name -> strategy), each field sometimes missing or replaced by any JSON value;
    a record sometimes given as JSON text, sometimes as a broken string."""
    # each field is its own kind three times in four, and records are mappings four times in six
    record = st.fixed_dictionaries({name: st.one_of(strategy, strategy, strategy, json_values)
                                    for name, strategy in fields.items()})
    record = record | record | st.fixed_dictionaries({}, optional={name: strategy | json_values
                                                                    for name, strategy in fields.items()})
    as_text = record.map(lambda r: json.dumps(r, allow_nan=True))
    return st.lists(st.one_of(record, record, record, record, as_text, texts), min_size=1, max_size=4)


def refused_by_name(error: Exception) -> bool:
    """A RecordError names the source, row and field; a whole-input problem names the loader."""
    text = str(error)
    return " row " in text if isinstance(error, RecordError) else text.split(":")[0] in LOADERS


def first_batch(loader):
    return next(iter(loader.load(batch=1).train(Partition(index=0, count=1))))


def check_loader(build, records, good):
    """``build(records)`` loads or refuses by name; then ``build(good)`` still loads."""
    try:
        batch = first_batch(build(records))
    except (ValueError, TypeError) as error:
        assert refused_by_name(error), f"{type(error).__name__}: {error}"
        event("refused")
    else:
        event("loaded")
        assert all(isinstance(value, np.ndarray) and value.shape[0] == 1 for value in batch.values())
    first_batch(build(good))


PAIR = {"chosen": [1, 5, 6, 2], "rejected": [1, 5, 7, 2], "chosen_mask": [0, 1, 1, 1], "rejected_mask": [0, 1, 1, 1]}


@FUZZ
@given(records_of({"chosen": ids, "rejected": ids, "chosen_mask": ids, "rejected_mask": ids}))
def test_preference_pairs_of_ids_load_or_name_the_row(records):
    check_loader(lambda rows: PreferencePairs(rows, seq_len=8), records, [PAIR])


@FUZZ
@given(records_of({"prompt": texts, "chosen": texts, "rejected": texts}))
def test_preference_pairs_of_text_load_or_name_the_row(records):
    good = [{"prompt": "Tom had a cat.", "chosen": " The cat was red.", "rejected": " The dog ran."}]
    check_loader(lambda rows: PreferencePairs(rows, seq_len=48, tokenizer=TOKENIZER), records, good)


roles = st.sampled_from(["system", "user", "assistant", "tool"])
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(roles, roles, roles, texts),
                                           "content": st.one_of(texts, texts, texts, json_values)}), max_size=4)


@FUZZ
@given(records_of({"prompt": messages | texts, "chosen": messages, "rejected": messages}))
def test_preference_pairs_of_chat_messages_load_or_name_the_row(records):
    good = [{"prompt": [{"role": "user", "content": "Tom had a cat."}],
             "chosen": [{"role": "assistant", "content": "The cat was red."}],
             "rejected": [{"role": "assistant", "content": "The dog ran."}]}]
    check_loader(lambda rows: PreferencePairs(rows, seq_len=48, tokenizer=TOKENIZER), records, good)


@FUZZ
@given(records_of({"prompt": ids | texts | messages, "data_source": texts, "ground_truth": texts,
                   "extra_info": json_values, "reward_model": json_values}))
def test_prompts_load_or_name_the_row(records):
    good = [{"prompt": "Tom had a cat.", "data_source": "stories", "ground_truth": "cat"}]
    check_loader(lambda rows: Prompts(rows, tokenizer=TOKENIZER, max_prompt_len=16), records, good)


@FUZZ
@given(records_of({"messages": messages}))
def test_chat_rows_load_or_name_the_row(records):
    good = [{"messages": [{"role": "user", "content": "Tom had a cat."}, {"role": "assistant", "content": "Yes."}]}]
    with tempfile.TemporaryDirectory() as folder:
        def chat(rows):  # a JSONL file, one line per record (a string record is the line itself)
            path = Path(folder) / f"{len(list(Path(folder).iterdir()))}.jsonl"
            path.write_text("".join((row if isinstance(row, str) else json.dumps(row)).replace("\n", " ") + "\n"
                                    for row in rows))
            return ChatMessages(TOKENIZER, path, seq_len=63)

        check_loader(chat, records, good)


# ----- run configs: keyword values and --set overrides ------------------------------------------------------

config_values = json_values | st.floats() | st.sampled_from([0, 1, -1, 2.5, "none", "true", "x", math.inf, [], {}])


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(RLVRPipelineConfig.model_fields) + ["stepz", ""]), config_values,
                       max_size=4))
def test_pipeline_config_values_build_or_name_the_field(values):
    try:
        config = RLVRPipelineConfig(**values)
    except ConfigError as error:
        assert any(f"'{name}'" in str(error) for name in values) or "must be at least" in str(error), str(error)
    else:
        assert RLVRPipelineConfig(**config.model_dump()) == config  # what it holds builds it again
    assert RLVRPipelineConfig(steps=3).steps == 3


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(sorted(RLVRPipelineConfig.model_fields) + ["stepz"]),
                          st.text(max_size=12)).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=16),
                max_size=3))
def test_overrides_read_or_name_the_field(overrides):
    try:
        load_config(RLVRPipelineConfig, None, overrides)
    except ConfigError as error:
        assert "config field" in str(error) or "override" in str(error) or "must be" in str(error), str(error)


@FUZZ
@given(st.dictionaries(st.sampled_from(["model", "stages", "batch", "trackers", "run_dir"]), config_values,
                       min_size=1, max_size=3))
def test_chain_config_values_build_or_name_the_field(values):
    try:
        ChainConfig(**values)
    except ConfigError as error:
        assert any(f"'{name}" in str(error) for name in (*values, "model", "stages")), str(error)
