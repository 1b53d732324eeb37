"""One trainer process of tests/test_flow_grpo.py's two-process check: Flow-GRPO with FlowRollout.

``flow_worker.py SCENARIO PROCESS PORT OUT`` joins a two-process CPU job (gloo) unless SCENARIO is
"reference", which trains alone on the devices XLA_FLAGS gives it. The global data at step k is
source rows [2k, 2k + 1] (a ``source`` column beside the zero image field); each process reads
its partition's rows. The reward is the samples' brightness plus 1e-3 times the source row plus
1e-12 times the sample's position, so each score names its row and keeps bits float32 would
lose. Two updates; OUT gets every rollout batch, each reward call's size on this process, the
float64 scores this process trained on and the final parameters.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jobs import run_job  # noqa: E402 (tests/workers, the script's own folder)


def main(scenario: str, process: int, port: str, out: str) -> None:
    if scenario != "reference":
        from dew.sharding import initialize_processes

        initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=1)

    import itertools

    import jax
    import numpy as np
    import optax

    from dew import Dataset, Field, InputSpec, Trainer, models, presets
    from dew.collection.flow_rollout import FlowRollout
    from dew.objectives.flow_grpo import FlowGRPOObjective

    model = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2, mlp_ratio=2)
    objective = FlowGRPOObjective(model, presets.Flow()(), InputSpec(Field("image", (4, 4, 1))), beta=0.01, steps=5)
    calls = []

    def reward(images, batch):
        calls.append(len(images))
        position = np.arange(len(images)) % 4
        return images.mean(axis=(1, 2, 3)).astype(np.float64) + 1e-3 * batch["source"] + 1e-12 * position

    flow = FlowRollout(objective, reward, groups=4, steps=5, train_steps=2)
    batches = []

    def rollout(batch, variables, version, key):
        made = flow(batch, variables, version, key)
        batches.append({name: np.asarray(value).tolist() for name, value in made.items()})
        return made

    def rows(partition):
        for step in itertools.count():
            mine = np.arange(2 * step, 2 * step + 2)[partition.index * (2 // partition.count):][: 2 // partition.count]
            yield {"image": np.zeros((len(mine), 4, 4, 1), np.uint8), "source": mine.astype(np.int32)}

    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout, progress=False)
    state = trainer.fit(Dataset(train=rows, batch=2), steps=2)
    summary = {
        "params": [np.asarray(leaf.addressable_data(0)).tolist() for leaf in jax.tree.leaves(state.params)],
        "updates": int(state.updates),
        "batches": batches,
        "calls": calls,
        "scores": [float(s) for s in flow.scores],
        "score_bits": flow.scores.view(np.uint64).tolist(),
    }
    with open(out, "w") as handle:
        json.dump(summary, handle)


if __name__ == "__main__":
    run_job(main)
