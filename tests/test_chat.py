"""ChatMessages: roles from chat templates, TRL parity on the real Qwen vocabulary, packing and errors."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import import_from

from dew.data import ChatMessages, HFOptions, Loading, Partition, RecordError, Role
from dew.data.stories import story_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "chat_qwen3.json").read_text())


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    """The Qwen3 tokenizer of tools/parity_chat.py, saved so ChatMessages loads it with AutoTokenizer."""
    directory = tmp_path_factory.mktemp("qwen3")
    import_from("tools", "qwen3_vocab").qwen3_tokenizer().save_pretrained(directory)
    return directory


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def test_ids_and_assistant_mask_equal_trl_exactly(qwen_path, tmp_path):
    rows = [{"messages": c["messages"], **({"tools": c["tools"]} if "tools" in c else {})} for c in FIXTURE["conversations"]]
    chat = ChatMessages(tokenizer=str(qwen_path), path=write_jsonl(tmp_path / "c.jsonl", rows), seq_len=255)
    for record, expected in zip(chat.records, FIXTURE["conversations"], strict=True):
        ids, roles = chat.render(*chat.messages_of(record))
        assert ids == expected["input_ids"]
        assert [int(r == Role.ASSISTANT) for r in roles] == expected["assistant_masks"]
    print(f"{len(FIXTURE['conversations'])} conversations equal TRL {FIXTURE['trl_version']} exactly")


def test_prefix_renders_equal_apply_chat_template(qwen_path, tmp_path):
    # ChatMessages renders a conversation's prefixes through transformers' renderer in two calls;
    # each must be what apply_chat_template gives for that prefix alone.
    rows = [{"messages": c["messages"], **({"tools": c["tools"]} if "tools" in c else {})} for c in FIXTURE["conversations"]]
    chat = ChatMessages(tokenizer=str(qwen_path), path=write_jsonl(tmp_path / "c.jsonl", rows), seq_len=255)
    for record in chat.records:
        messages, tools = chat.messages_of(record)
        prefixes = [(end, generation) for end in range(1, len(messages) + 1) for generation in (False, True)]
        expected = [chat.tokenizer.apply_chat_template(messages[:end], tools=tools, tokenize=False,
                                                       add_generation_prompt=generation) for end, generation in prefixes]
        assert chat._texts(prefixes, messages, tools, record) == expected


def test_roles_follow_the_messages_and_the_header_is_not_assistant(qwen_path, tmp_path):
    conversation = FIXTURE["conversations"][2]  # user, assistant with a tool call, tool, assistant
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation["messages"], "tools": conversation["tools"]}])
    chat = ChatMessages(tokenizer=str(qwen_path), path=path, seq_len=255)
    ids, roles = chat.render(*chat.messages_of(chat.records[0]))
    text = lambda role: chat.tokenizer.decode([i for i, r in zip(ids, roles) if r == role])  # noqa: E731
    assert text(Role.HEADER) == "<|im_start|>assistant\n" * 2
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text(Role.ASSISTANT)
    assert text(Role.TOOL) == '<|im_start|>user\n<tool_response>\n{"celsius": 24}\n</tool_response><|im_end|>\n'
    assert text(Role.USER).startswith("<|im_start|>system\n# Tools")  # the tool schemas render with the first message


def test_load_packs_conversations_with_segments_positions_and_roles(qwen_path, tmp_path):
    rows = [{"messages": c["messages"], "tools": json.dumps(c.get("tools"))} for c in FIXTURE["conversations"]]
    pq.write_table(pa.Table.from_pylist([{"messages": json.dumps(r["messages"]), "tools": r["tools"]} for r in rows]),
                   tmp_path / "c.parquet")
    chat = ChatMessages(tokenizer=str(qwen_path), path=tmp_path / "c.parquet", seq_len=255, loading=Loading(shuffle=False))
    dataset = chat.load(batch=2)
    batch = next(dataset.train(Partition()))
    assert set(batch) == {"text", "text_roles", "text_segment_ids", "text_positions"}
    assert all(value.shape == (2, 256) for value in batch.values())
    assert batch["text_roles"].dtype == np.int8
    # Row 0 packs the first conversations in order; each segment restarts its positions at 0.
    first = FIXTURE["conversations"][0]["input_ids"]
    np.testing.assert_array_equal(batch["text"][0, : len(first)], first)
    segments, positions = batch["text_segment_ids"][0], batch["text_positions"][0]
    assert segments[len(first)] == 2 and positions[len(first)] == 0
    assert (batch["text_roles"][0][segments == 0] == Role.PAD).all() and (segments == 0).any()


def test_verl_prompt_column_and_datasets_sources(tmp_path):
    import datasets

    tokenizer = story_tokenizer()
    conversation = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]
    verl = ChatMessages(tokenizer=tokenizer, path=write_jsonl(tmp_path / "v.jsonl", [{"prompt": conversation}] * 4),
                        seq_len=63)
    ids, roles = verl.render(*verl.messages_of(verl.records[0]))
    assert tokenizer.decode([i for i, r in zip(ids, roles) if r == Role.ASSISTANT]) == "Four.<|endoftext|>"
    in_memory = datasets.Dataset.from_list([{"messages": conversation}] * 4)
    in_memory.save_to_disk(tmp_path / "saved")
    pq.write_table(pa.Table.from_pylist([{"messages": json.dumps(conversation)}] * 4), tmp_path / "d.parquet")
    sources = [in_memory, datasets.DatasetDict({"train": in_memory}), str(tmp_path / "saved")]
    for source in sources:
        loaded = ChatMessages(tokenizer=tokenizer, path=source, seq_len=63)
        assert loaded.render(*loaded.messages_of(loaded.records[3])) == (ids, roles)
    # A dataset id goes to datasets.load_dataset with the split and HFOptions (here a local builder: no download).
    by_id = ChatMessages(tokenizer=tokenizer, path="parquet", split="train",
                         options=HFOptions(data_files=str(tmp_path / "d.parquet")), seq_len=63)
    assert by_id.render(*by_id.messages_of(by_id.records[0])) == (ids, roles)
    with pytest.raises(ValueError, match="has splits \\['train'\\], not 'test'"):
        ChatMessages(tokenizer=tokenizer, path=datasets.DatasetDict({"train": in_memory}), split="test", seq_len=63)


def test_validation_split_and_training_through_load(tmp_path):
    tokenizer = story_tokenizer()
    rows = [{"messages": [{"role": "user", "content": f"Name {i}."}, {"role": "assistant", "content": "Tom."}]}
            for i in range(12)]
    chat = ChatMessages(tokenizer=tokenizer, path=write_jsonl(tmp_path / "t.jsonl", rows), seq_len=31,
                        val_path=write_jsonl(tmp_path / "v.jsonl", rows[:6]))
    dataset = chat.load(batch=2)
    val = list(dataset.val(Partition()))
    assert val and all(b["text"].shape == (2, 32) for b in val)


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"content": "hi"}], "row 0, field 'messages': message 0 has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}],
         "message 1 has role 'narrator'; the roles are \\['assistant', 'system', 'tool', 'user'\\]"),
        ([{"role": "assistant", "content": "hi"}], "starts with a assistant message; conversations start with system or user"),
        ([{"role": "user", "content": "word " * 80}], "renders to \\d+ tokens, more than seq_len \\+ 1 = 32"),
        ([], "must be a non-empty list of messages"),
    ],
)
def test_bad_conversations_name_file_row_and_field(tmp_path, messages, message):
    rows = [{"messages": [{"role": "user", "content": "ok"}]}] * 2
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": messages}] + rows)
    with pytest.raises(RecordError, match=f"bad.jsonl {message}" if message.startswith("row") else message):
        ChatMessages(tokenizer=story_tokenizer(), path=path, seq_len=31).load(batch=1)


def test_templates_without_chat_support_or_with_rewrites_are_refused(tmp_path):
    tokenizer = story_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="has no chat template"):
        ChatMessages(tokenizer=tokenizer, path=path, seq_len=31)
    # This template writes the last message differently from earlier ones, so prefixes do not extend.
    tokenizer.chat_template = "{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}{% endfor %}"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation}])
    with pytest.raises(RecordError, match="the chat template changes earlier tokens when it renders message 1 "
                                          "\\(its text differs from the render before at character 0: '\\[hi\\]' became 'hi\\[yo\\]'"):
        ChatMessages(tokenizer=tokenizer, path=path, seq_len=31).load(batch=1)


def test_a_render_that_ends_inside_a_token_is_refused(tmp_path):
    # No separators: the user's "To" and the assistant's "m" render as "Tom", one token of the story
    # vocabulary, which would belong to both messages.
    tokenizer = story_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert tokenizer.tokenize("Tom") == ["Tom"]
    conversation = [{"role": "user", "content": "To"}, {"role": "assistant", "content": "m"}]
    chat = ChatMessages(tokenizer=tokenizer, path=write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation}]),
                        seq_len=31)
    with pytest.raises(RecordError, match="the render of message 0 ends at character 2, inside token 0 \\('Tom'\\)"):
        chat.load(batch=1)
    # The same messages with a separator the tokenizer splits on get their roles.
    ids, roles = chat.render([{"role": "user", "content": "To "}, {"role": "assistant", "content": "m"}])
    assert roles == [Role.USER] * (len(ids) - 1) + [Role.ASSISTANT]


def test_a_tokenizer_without_offsets_is_refused(tmp_path):
    from transformers import PreTrainedTokenizer

    class Letters(PreTrainedTokenizer):  # a python tokenizer: no character offsets
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="is not a fast \\(Rust tokenizers\\) one"):
        ChatMessages(tokenizer=Letters.__new__(Letters), path=path, seq_len=31)


def test_sft_on_chat_rows_counts_only_assistant_targets(tmp_path):
    import jax
    import optax

    from dew import Trainer, models
    from dew.objectives import LMObjective

    tokenizer = story_tokenizer()
    rows = [{"messages": [{"role": "user", "content": f"Tell me about {name}."},
                          {"role": "assistant", "content": f"{name} had a red ball."}]} for name in ("Tom", "Lily") * 8]
    chat = ChatMessages(tokenizer=tokenizer, path=write_jsonl(tmp_path / "sft.jsonl", rows), seq_len=63)
    dataset = chat.load(batch=4)
    batch = next(dataset.train(Partition()))
    roles, segments = batch["text_roles"], batch["text_segment_ids"]
    expected = int(((roles[:, 1:] == Role.ASSISTANT) & (segments[:, 1:] == segments[:, :-1])).sum())
    model = models.build("causal_transformer", vocab_size=len(tokenizer), emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=63)
    trainer = Trainer(LMObjective(model, seq_len=63, loss_role=Role.ASSISTANT, ema_decay=None), optax.adam(1e-2),
                      key=jax.random.key(0), progress=False)
    state, metrics = trainer.step(trainer.initial_state(), batch)
    assert metrics["target_tokens"] == expected > 0
    state = trainer.fit(dataset, steps=5, log_every=5)
    assert int(state.updates) == 5
