"""A small built-in story corpus and a byte-level BPE tokenizer trained on it.

Demos and tests need text and a tokenizer without downloading anything. The corpus
is made from templates with a seeded generator (short children's stories in the
style of TinyStories); the tokenizer is a byte-level BPE trained on it locally with
the ``tokenizers`` package and wrapped as a ``transformers`` fast tokenizer with an
end-of-text token and a simple chat template. Neither is a useful language model
resource: they only make the pipelines run end to end offline.
"""

from __future__ import annotations

import random

from dew import models
from dew.data.dataset import Dataset, Partition
from dew.data.loading import Loading, row_stream
from dew.data.document_packing import pack_documents


NAMES = ("Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "Max", "Sue")
HE = {"Tom": "He", "Ben": "He", "Sam": "He", "Max": "He", "Lily": "She", "Mia": "She", "Anna": "She", "Sue": "She"}
ANIMALS = ("dog", "cat", "bird", "frog", "duck", "fish")
THINGS = ("ball", "kite", "box", "hat", "car", "cake", "book")
COLORS = ("red", "blue", "green", "big", "little", "yellow")
PLACES = ("park", "garden", "house", "forest", "pond")
FEELINGS = ("happy", "sad", "sleepy", "hungry", "scared")

EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _story(rng: random.Random) -> str:
    name, animal, thing = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(THINGS)
    color, place, feeling = rng.choice(COLORS), rng.choice(PLACES), rng.choice(FEELINGS)
    he = HE[name]
    his = "his" if he == "He" else "her"
    kind = "boy" if he == "He" else "girl"
    openings = (
        f"Once upon a time, there was a little {kind} named {name}.",
        f"Once upon a time, there was a little {animal}.",
        f"{name} had a {color} {thing}.",
        f"One day, {name} went to the {place}.",
    )
    middles = (
        f"{name} had a {color} {thing}.",
        f"{he} kicked it to {his} {animal}.",
        f"{he} liked to play with the {animal}.",
        f"The {animal} was {feeling}.",
        f"{he} saw a {color} {animal} in the {place}.",
        f"{name} and the {animal} played all day.",
        f"{he} gave the {thing} to {his} mom.",
        f"The {animal} ran to the {place}.",
    )
    endings = (
        f"{name} was very {feeling}.",
        "They were best friends.",
        f"{he} went home and slept.",
        f"The {animal} and {name} were happy.",
    )
    sentences = [rng.choice(openings)] + rng.sample(middles, rng.randint(2, 4)) + [rng.choice(endings)]
    return " ".join(sentences)


def stories(count: int = 2000, seed: int = 0) -> list[str]:
    """``count`` short stories, the same for the same seed."""
    rng = random.Random(seed)
    return [_story(rng) for _ in range(count)]


def story_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE trained on the built-in stories, as a ``PreTrainedTokenizerFast``.

    Id 0 is ``<|endoftext|>``, which serves as end-of-sequence, beginning-of-sequence
    and padding token. The chat template writes ``<|role|>content<|endoftext|>`` per
    message.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = stories() if corpus is None else corpus
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def story_dataset(tokenizer, seq_len: int, batch: int, count: int = 2000, val_count: int = 64, seed: int = 0) -> Dataset:
    """Stories packed into ``[batch, seq_len + 1]`` rows (EOS after each), with a held-out split.

    The validation stories come from another seed, so none is a training story by
    construction of the split (templates make some sentences recur in both).
    """
    def encode(texts):
        return [tokenizer.encode(text) + [tokenizer.eos_token_id] for text in texts]

    train_rows = pack_documents(encode(stories(count, seed)), seq_len + 1, pad_id=tokenizer.pad_token_id)
    val_rows = pack_documents(encode(stories(val_count, seed + 1)), seq_len + 1, pad_id=tokenizer.pad_token_id)
    val_batches = len(val_rows["text"]) // batch
    if val_batches == 0:
        raise ValueError(f"{val_count} validation stories fill fewer than one batch of {batch} rows")

    def val(partition: Partition):
        for b in range(val_batches):
            rows = slice(b * batch + partition.index, (b + 1) * batch, partition.count)
            yield {name: column[rows] for name, column in val_rows.items()}

    return Dataset(
        train=row_stream(train_rows, batch, Loading(seed=seed), "story_dataset"),
        val=val,
        records=len(train_rows["text"]),
        batch=batch,
    )


def story_decoder(vocab_size: int, max_seq_len: int = 64):
    """The tiny decoder the demos train: 2 layers, 64 features, 4 heads (2 KV heads)."""
    return models.build(
        "causal_transformer",
        vocab_size=vocab_size,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_features=128,
        max_seq_len=max_seq_len,
    )
