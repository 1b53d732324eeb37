"""Stand-in for the spec's "Train a decoder on TinyStories" session.

The spec's continuation examples (SFT, DPO, GRPO) "reuse its model, lm_state,
tokenizer and imports". dew-ray cannot download TinyStories or its tokenizer, so this
module builds the same names offline: a byte-level BPE trained on dew's built-in
story corpus, a small decoder, and ``lm_state`` from a few hundred steps of
next-token training on those stories. Importing it runs that pre-training (about
half a minute on two CPU cores); then run a spec block in the same namespace:

    from tinystories import *          # with examples/ on sys.path
    exec(open("examples/spec/sft.py").read())
"""

import itertools  # noqa: F401  (the spec's blocks use these names)

import jax
import numpy as np  # noqa: F401
import optax

from dew import Dataset, Trainer, models  # noqa: F401
from dew.data import Loading  # noqa: F401
from dew.data.chat import Role  # noqa: F401
from dew.data.stories import story_dataset, story_decoder, story_tokenizer
from dew.objectives import LMObjective
from dew.sampling import Sampling  # noqa: F401

SEQ_LEN = 64
PRETRAIN_STEPS = 300

tokenizer = story_tokenizer()
model = story_decoder(len(tokenizer), max_seq_len=SEQ_LEN)
lm_data = story_dataset(tokenizer, seq_len=SEQ_LEN, batch=16)
lm_state = Trainer(
    LMObjective(model, seq_len=SEQ_LEN, ema_decay=None),
    optax.adamw(3e-3),
    key=jax.random.key(0),
    progress=False,
).fit(lm_data, steps=PRETRAIN_STEPS, log_every=PRETRAIN_STEPS)

# The DPO block reuses the prompt and response the SFT block defines; defining them here
# (the same strings) lets the blocks run in any order, as the spec promises.
prompt = tokenizer.encode("Tom had a red ball.")
response = tokenizer.encode(" He kicked it to his dog.")

__all__ = [
    "Dataset", "LMObjective", "Loading", "Role", "Trainer", "itertools", "jax", "lm_state", "model", "models", "np",
    "optax", "prompt", "response", "Sampling", "tokenizer",
]
