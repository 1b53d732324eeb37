"""The stage chain (dew.recipes.stage_chain): SFT -> DPO -> GRPO on tiny data, each stage from the last one's policy."""

import json

import jax
import numpy as np
import optax
import pytest

from dew.data import ChatMessages, Loading, PreferencePairs, Prompts
from dew.data.stories import story_decoder, story_tokenizer
from dew.recipes.stage_chain import Recipe, Stage

SERIAL = Loading(workers=0, threads=1, shuffle=False)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = story_tokenizer()
    return tokenizer, story_decoder(len(tokenizer), max_seq_len=64)


def stage_data(tokenizer, folder):
    conversations = folder / "chat.jsonl"
    with open(conversations, "w") as handle:
        for story in ("Tom had a red ball.", "Sue saw a big dog.", "The cat ran home.", "Ben liked the sun."):
            messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": story}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    prompt, good, bad = tokenizer.encode("Tom had"), tokenizer.encode(" a ball."), tokenizer.encode(" ball ball.")
    pair = {"chosen": prompt + good, "rejected": prompt + bad, "chosen_mask": [0] * len(prompt) + [1] * len(good),
            "rejected_mask": [0] * len(prompt) + [1] * len(bad)}
    prompts = [{"prompt": tokenizer.encode(text), "data_source": "stories", "ground_truth": "dog"}
               for text in ("Once there was", "Tom had a", "The dog", "Sue saw")]
    return (ChatMessages(tokenizer, conversations, seq_len=63, loading=SERIAL),
            PreferencePairs(records=[json.dumps(pair)] * 4, seq_len=16, loading=SERIAL),
            Prompts(records=prompts, max_prompt_len=6, loading=SERIAL))


def dog(data_source, completion, ground_truth, extra_info):
    return float(len(completion.split()) % 3 == 0)  # token-id text: any scalar the groups can differ on


def recipe(tiny, folder, **changes):
    tokenizer, model = tiny
    chat, pairs, prompts = stage_data(tokenizer, folder)
    stages = (Stage("sft", chat, steps=3), Stage("dpo", pairs, steps=2, beta=0.1),
              Stage("grpo", prompts, steps=2, beta=0.01, reward=dog, groups=2, max_new_tokens=4, sample={"top_k": 20}))
    options = dict(model=model, optimizer=optax.adam(1e-3), key=jax.random.key(0), output_dir=folder / "run", batch=4,
                   stages=stages, progress=False)
    return Recipe(**{**options, **changes})


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_each_stage_starts_from_the_previous_final_policy_and_a_rerun_restores(tiny, tmp_path):
    chain = recipe(tiny, tmp_path)
    states = chain.run()
    assert [int(s.step) for s in states] == [3, 2, 2] and [int(s.updates) for s in states] == [3, 2, 2]
    assert states[0].ema is None  # SFT keeps no averaged copy
    for reference, previous in ((states[1].ema, states[0].params), (states[2].ema, states[1].params)):
        for a, b in zip(leaves(reference), leaves(previous), strict=True):
            np.testing.assert_array_equal(a, b)  # DPO and GRPO froze the previous stage's final policy
    for later, earlier in ((states[1], states[0]), (states[2], states[1])):
        assert any(not np.array_equal(a, b) for a, b in zip(leaves(later.params), leaves(earlier.params)))
    start = chain.initial_variables()
    sft, _ = chain.objective(chain.stages[0], start)
    assert sft.init(jax.random.key(9)) is start  # the first stage starts from the chain's start
    for name in ("sft", "dpo", "grpo"):
        assert (tmp_path / "run" / name / "metrics.jsonl").exists()
    lines = {name: (tmp_path / "run" / name / "metrics.jsonl").read_text() for name in ("sft", "dpo", "grpo")}
    again = recipe(tiny, tmp_path).run()  # every stage directory holds its checkpoint: restore, train nothing
    for first, second in zip(states, again, strict=True):
        assert int(second.step) == int(first.step)
        for a, b in zip(leaves(first.params), leaves(second.params), strict=True):
            np.testing.assert_array_equal(a, b)
    assert lines == {name: (tmp_path / "run" / name / "metrics.jsonl").read_text() for name in lines}


def test_a_new_stage_after_restored_ones_starts_from_the_restored_policy(tiny, tmp_path):
    first = recipe(tiny, tmp_path)
    sft_only = recipe(tiny, tmp_path, stages=first.stages[:1]).run()
    full = first.run()
    for a, b in zip(leaves(full[1].ema), leaves(sft_only[0].params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_stage_options_are_checked_by_name(tiny, tmp_path):
    chat, pairs, prompts = stage_data(tiny[0], tmp_path)
    with pytest.raises(ValueError, match="needs reward"):
        Stage("rl", prompts, steps=1)
    with pytest.raises(ValueError, match="stage 'sft' is SFT .its data is ChatMessages.; reward, groups apply to GRPO"):
        Stage("sft", chat, steps=1, reward=dog, groups=8)
    with pytest.raises(ValueError, match="beta applies to DPO and GRPO"):
        Stage("sft", chat, steps=1, beta=0.1)
    with pytest.raises(ValueError, match="does not expose the rollout's decode, eos_id or temperature"):
        Stage("rl", prompts, steps=1, reward=dog, sample={"temperature": 0.7})
    with pytest.raises(TypeError, match="data must be ChatMessages .SFT., PreferencePairs .DPO. or Prompts .GRPO."):
        Stage("x", [1, 2], steps=1)
    with pytest.raises(ValueError, match="plain directory name"):
        Stage("../up", chat, steps=1)
    with pytest.raises(ValueError, match="must differ"):
        recipe(tiny, tmp_path, stages=(Stage("a", chat, steps=1), Stage("a", pairs, steps=1)))
