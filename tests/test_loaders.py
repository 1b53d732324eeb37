import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dew.data import Loading, Partition, PreferencePairs, Prompts, RecordError
from dew.data.prompts import utf8_text
from dew.data.stories import story_tokenizer

PAIR = {"chosen": [1, 2, 3, 5], "rejected": [1, 2, 4, 4, 5], "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1, 1]}


def pairs(count, **change):
    return [json.dumps({**PAIR, "chosen": [1, 2, 3 + i % 3, 5], **change}) for i in range(count)]


def first_batch(dataset, partition=Partition()):
    return next(iter(dataset.train(partition)))


def test_pairs_are_right_padded_with_zero_mask():
    batch = first_batch(PreferencePairs(records=pairs(8), seq_len=6, pad_id=7).load(batch=8))
    assert batch["input_ids"].shape == batch["completion_mask"].shape == (8, 2, 6)
    assert batch["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(batch["input_ids"][0, 1], [1, 2, 4, 4, 5, 7])
    np.testing.assert_array_equal(batch["completion_mask"][0, 1], [0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch["completion_mask"][0, 0], [0, 0, 1, 1, 0, 0])


def test_a_missing_mask_means_all_completion():
    record = {"chosen": [1, 2], "rejected": [3, 4, 5]}
    batch = first_batch(PreferencePairs(records=[record] * 2, seq_len=4).load(batch=2))
    np.testing.assert_array_equal(batch["completion_mask"][0], [[1, 1, 0, 0], [1, 1, 1, 0]])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rejected_mask": [0, 1]}, "records row 3, field 'rejected_mask': has 2 entries but rejected has 5 ids"),
        ({"chosen": [1] * 9, "chosen_mask": None}, "records row 3, field 'chosen': has 9 ids, more than seq_len=6"),
        ({"rejected": None}, "records row 3, field 'rejected': expected a list of token ids, got NoneType"),
        ({"chosen": [1, -2, 3, 5]}, "records row 3, field 'chosen': item 1 is -2"),
        ({"chosen": [1, True, 3, 5]}, "records row 3, field 'chosen': item 1 is True"),
        ({"chosen_mask": [0, 0, 2, 1]}, "records row 3, field 'chosen_mask': entries must be 0"),
        ({"chosen_mask": [0, 0, 0, 0]}, "records row 3, field 'chosen_mask': marks no completion token"),
    ],
)
def test_bad_pairs_name_row_and_field(change, message):
    records = pairs(3) + [json.dumps({**PAIR, **change})]
    with pytest.raises(RecordError, match=message.replace("(", "\\(").replace(")", "\\)")):
        PreferencePairs(records=records, seq_len=6).load(batch=4)


def test_records_and_path_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="exactly one of records= and path=, got both records and path"):
        PreferencePairs(records=pairs(2), path=tmp_path / "x.parquet", seq_len=6)
    with pytest.raises(ValueError, match="got neither records nor path"):
        PreferencePairs(seq_len=6)
    with pytest.raises(RecordError, match="records row 1: not valid JSON"):
        PreferencePairs(records=[pairs(1)[0], "{oops"], seq_len=6)


def test_parquet_and_jsonl_files_read_like_records(tmp_path):
    rows = [json.loads(r) for r in pairs(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loading = Loading(shuffle=False)
    expected = first_batch(PreferencePairs(records=pairs(8), seq_len=6, loading=loading).load(batch=8))
    for name in ("pairs.parquet", "pairs.jsonl"):
        batch = first_batch(PreferencePairs(path=tmp_path / name, seq_len=6, loading=loading).load(batch=8))
        np.testing.assert_array_equal(batch["input_ids"], expected["input_ids"])
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="cannot read .*bad.parquet as Parquet"):
        PreferencePairs(path=bad, seq_len=6)
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[0], "chosen": "x"}) + "\n")
    with pytest.raises(RecordError, match="bad.jsonl row 1, field 'chosen'"):
        PreferencePairs(path=tmp_path / "bad.jsonl", seq_len=6).load(batch=1)


def ids_of(dataset, steps, partition=Partition()):
    stream = dataset.train(partition)
    return [next(stream)["input_ids"][:, 0, 2].tolist() for _ in range(steps)]


def test_order_is_deterministic_for_a_seed_and_parallel_encoding_agrees():
    records = [json.dumps({**PAIR, "chosen": [1, 2, i, 5]}) for i in range(20)]
    one = ids_of(PreferencePairs(records=records, seq_len=6, loading=Loading(seed=3)).load(batch=4), 12)
    assert one == ids_of(PreferencePairs(records=records, seq_len=6, loading=Loading(seed=3, threads=2)).load(batch=4), 12)
    assert one != ids_of(PreferencePairs(records=records, seq_len=6, loading=Loading(seed=4)).load(batch=4), 12)
    # Each epoch of 5 batches visits every record once, in a new order.
    assert sorted(sum(one[:5], [])) == list(range(20)) and sorted(sum(one[5:10], [])) == list(range(20))
    assert one[:5] != one[5:10]
    in_order = ids_of(PreferencePairs(records=records, seq_len=6, loading=Loading(shuffle=False)).load(batch=4), 2)
    assert in_order == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_processes_read_disjoint_partitions_and_positions_restore():
    records = [json.dumps({**PAIR, "chosen": [1, 2, i, 5]}) for i in range(20)]
    loader = PreferencePairs(records=records, seq_len=6)
    dataset = loader.load(batch=4)
    first, second = Partition(0, 2), Partition(1, 2)
    assert {r % 2 for r in sum(ids_of(dataset, 5, first), [])} == {0}
    assert {r % 2 for r in sum(ids_of(dataset, 5, second), [])} == {1}
    assert len(ids_of(dataset, 1, first)[0]) == 2  # each process holds half of the global batch
    stream = dataset.train(Partition())
    for _ in range(7):
        next(stream)
    position = stream.position()
    expected = [next(stream)["input_ids"].tolist() for _ in range(4)]
    resumed = dataset.train(Partition())
    resumed.restore(json.loads(json.dumps(position)))
    assert [next(resumed)["input_ids"].tolist() for _ in range(4)] == expected


def test_loading_options_are_checked():
    with pytest.raises(ValueError, match="Loading.threads must be a positive integer, got 0"):
        Loading(threads=0)
    with pytest.raises(ValueError, match="a batch of 3 rows|fewer than one batch"):
        PreferencePairs(records=pairs(2), seq_len=6).load(batch=3)


@pytest.fixture(scope="module")
def tokenizer():
    return story_tokenizer()


def test_conversational_pairs_mask_what_each_side_adds_to_the_prompts_render(tokenizer):
    """TRL's conversational explicit-prompt layout, tokenized as its DPOTrainer does: the prompt with the generation
    header, then what the render of prompt and answer adds; the template closes the turn, so no EOS is added."""
    prompt = [{"role": "user", "content": "Tom had a red ball."}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "He was happy."}],
              "rejected": [{"role": "assistant", "content": "It was sad."}]}
    batch = first_batch(PreferencePairs(records=[record] * 2, seq_len=48, tokenizer=tokenizer).load(batch=2))
    context = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    context = context["input_ids"] if hasattr(context, "keys") else context
    for index, side in enumerate(("chosen", "rejected")):
        ids, mask = batch["input_ids"][0, index], batch["completion_mask"][0, index]
        length = int((mask > 0).sum()) + len(context)
        assert ids[:len(context)].tolist() == list(context) and not mask[:len(context)].any()
        assert tokenizer.decode(ids[:length]) == f"<|user|>Tom had a red ball.<|endoftext|><|assistant|>" \
                                                 f"{record[side][0]['content']}<|endoftext|>"
        assert mask[len(context):length].all() and not mask[length:].any() and (ids[length:] == 0).all()
    with pytest.raises(RecordError, match="row 0, field 'prompt': a conversational pair needs the prompt as a "
                                          "non-empty list of chat messages"):
        PreferencePairs(records=[{**record, "prompt": "Tom had a red ball."}], seq_len=48,
                        tokenizer=tokenizer).load(batch=1)
    with pytest.raises(RecordError, match="row 0, field 'rejected': message 0 has no 'content' string"):
        PreferencePairs(records=[{**record, "rejected": [{"role": "assistant"}]}], seq_len=48,
                        tokenizer=tokenizer).load(batch=1)
    with pytest.raises(RecordError, match="row 0, field 'chosen': holds chat messages, so PreferencePairs needs a "
                                          "tokenizer"):
        PreferencePairs(records=[record], seq_len=48).load(batch=1)


def prompt_batch(records, **options):
    options = {"max_prompt_len": 6, "loading": Loading(shuffle=False), **options}
    return first_batch(Prompts(records=records, **options).load(batch=len(records)))


def test_prompts_are_left_padded_and_keep_their_end(tokenizer):
    batch = prompt_batch([{"prompt": [5, 6, 7]}, {"prompt": list(range(1, 10))}])
    np.testing.assert_array_equal(batch["prompt"], [[0, 0, 0, 5, 6, 7], [4, 5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(batch["prompt_length"], [3, 6])
    assert batch["prompt"].dtype == np.int32 and batch["prompt_length"].dtype == np.int32
    text = prompt_batch([{"prompt": "Tom had a red ball."}], tokenizer=tokenizer)
    assert tokenizer.decode(text["prompt"][0, -int(text["prompt_length"][0]):]) == "Tom had a red ball."
    chat = prompt_batch([{"prompt": [{"role": "user", "content": "hi"}]}], tokenizer=tokenizer, max_prompt_len=32)
    rendered = tokenizer.decode(chat["prompt"][0, -int(chat["prompt_length"][0]):])
    assert rendered == "<|user|>hi<|endoftext|><|assistant|>"  # generation header included


def test_metadata_travels_as_utf8_bytes_and_verl_rows_map(tokenizer):
    verl_row = {
        "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is two plus two?"}],
        "ability": "math", "agent_name": "tool_agent", "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0, "split": "train", "tools_kwargs": {"calc": {"create_kwargs": {"x": 1}}}},
    }
    batch = prompt_batch([verl_row, {"prompt": [1], "ground_truth": "dög"}], tokenizer=tokenizer, max_prompt_len=32)
    assert set(batch) == {"prompt", "prompt_length", "data_source", "ground_truth", "extra_info"}
    assert [utf8_text(r) for r in batch["data_source"]] == ["openai/gsm8k", ""]
    assert [utf8_text(r) for r in batch["ground_truth"]] == ["4", "dög"]
    assert json.loads(utf8_text(batch["extra_info"][0]))["tools_kwargs"] == {"calc": {"create_kwargs": {"x": 1}}}
    # The spec's layout: np.frombuffer(b"...", dtype=np.uint8).astype(np.int32), zero-padded.
    np.testing.assert_array_equal(batch["ground_truth"][1], np.frombuffer("dög".encode(), np.uint8))
    assert batch["ground_truth"].dtype == np.int32


def test_prompt_errors_name_row_and_field(tokenizer):
    with pytest.raises(RecordError, match="records row 1, field 'prompt': is a str, not a list of token ids, so Prompts needs a tokenizer"):
        Prompts(records=[{"prompt": [1]}, {"prompt": "hello"}], max_prompt_len=4)
    with pytest.raises(RecordError, match="records row 0, field 'prompt': message 1 has no 'role'"):
        Prompts(records=[{"prompt": [{"role": "user", "content": "a"}, {"content": "b"}]}], tokenizer=tokenizer,
                max_prompt_len=4).load(batch=1)
    with pytest.raises(RecordError, match="records row 0, field 'prompt': missing"):
        Prompts(records=[{"ground_truth": "x"}], tokenizer=tokenizer, max_prompt_len=4).load(batch=1)
    # Token-id prompts never load a tokenizer, even when one is named.
    Prompts(records=[{"prompt": [1, 2]}], tokenizer="/no/such/tokenizer", max_prompt_len=4).load(batch=1)


@pytest.mark.slow
def test_worker_processes_encode_the_same_rows(tokenizer):
    records = [{"prompt": f"Tom had a {color} ball.", "ground_truth": color} for color in ("red", "blue", "green", "big")]
    inline = prompt_batch(records, tokenizer=tokenizer, max_prompt_len=12)
    spawned = prompt_batch(records, tokenizer=tokenizer, max_prompt_len=12, loading=Loading(workers=1, shuffle=False))
    for name in inline:
        np.testing.assert_array_equal(inline[name], spawned[name])
