import json

import jax
import numpy as np
import optax

from dew import Trainer, models
from dew.data import Loading, PreferencePairs
from dew.objectives.rl import DPOObjective

rows = [
    {
        "chosen": [1, 2, 3, 5],
        "rejected": [1, 2, 4, 5],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_mask": [0, 0, 1, 1],
    },
    {
        "chosen": [1, 6, 3, 5],
        "rejected": [1, 6, 4, 5],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_mask": [0, 0, 1, 1],
    },
]
row_width = 4
spec = PreferencePairs(
    records=tuple(json.dumps(row) for row in rows * 4),
    seq_len=row_width,
    pad_id=0,
    loading=Loading(workers=0, threads=1, read_buffer=2),
)
data = spec.load(batch=8)
model = models.build(
    "causal_transformer",
    vocab_size=8,
    emb_features=16,
    num_layers=1,
    num_heads=2,
    mlp_features=32,
    max_seq_len=row_width,
)
objective = DPOObjective(model, seq_len=row_width - 1, beta=0.1)
trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0))
initial = trainer.initial_state()
# Copy the snapshot to host memory before training donates device buffers.
reference = jax.tree.map(lambda x: np.array(x, copy=True), initial.ema)
state = trainer.fit(data, steps=2, log_every=1)
assert int(state.step) == 2
for before, after in zip(
    jax.tree.leaves(reference), jax.tree.leaves(state.ema), strict=True
):
    np.testing.assert_allclose(before, np.asarray(after), rtol=0, atol=1e-6)
print("Completed", int(state.updates), "DPO updates; reference stayed fixed.")
