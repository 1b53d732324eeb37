"""Every objective trained on 8 CPU devices under several meshes, for tests/test_parallelism.py.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; prints one JSON object: per objective
and mesh, the losses of 5 updates and the final parameters, and per mesh the per-device bytes of
parameters and optimizer state. The batches each objective trains on are fixed (GRPO's are drawn
once by the replicated run's SampledRollout and replayed; PPO's and Flow-GRPO's come from their own
rollouts, which run on the sharded variables), so every mesh sees the same data.

The optimizer is AdamW with eps=1e-5: with Adam's default 1e-8, an element whose gradient is near
zero turns the last-bit difference of a sum taken in another order into a step of up to the
learning rate, which is no sharding error; the larger eps keeps each step proportional to its gradient.
"""

import itertools
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the objectives' own test helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew import Trainer, models  # noqa: E402
from dew.collection.sampled_rollout import SampledRollout  # noqa: E402
from dew.inference import Server  # noqa: E402
from dew.data.prompts import utf8_column  # noqa: E402
from dew.objectives import LMObjective  # noqa: E402
from dew.objectives.dpo import DPOObjective  # noqa: E402
from dew.objectives.grpo import GRPOObjective  # noqa: E402
from dew.parallelism import Parallelism, device_bytes  # noqa: E402
from dew.sampling import Sampling  # noqa: E402
from test_flow_grpo import FlowRollout, brightness, source_batch, spec_objective  # noqa: E402
from test_ppo import PPORollout, rollout, tasks  # noqa: E402
from test_ppo import objective as ppo_objective  # noqa: E402

assert jax.device_count() == 8, jax.devices()
MESHES = {
    "replicated": None,
    "fsdp 8": Parallelism(fsdp=8),
    "fsdp 4 x tensor 2": Parallelism(fsdp=4, tensor=2),
    "data 2 x fsdp 4": Parallelism(data=2, fsdp=4),
}
UPDATES = 5


def decoder(max_seq_len):
    return models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=4,
                        num_kv_heads=2, mlp_features=32, max_seq_len=max_seq_len, qk_norm=True)


def optimizer():
    return optax.adamw(1e-3, eps=1e-5)


def run(objective, batches, parallelism, rollout=None, key=0, devices=None, optimizer=optimizer):
    trainer = Trainer(objective, optimizer(), key=jax.random.key(key), rollout=rollout, parallelism=parallelism,
                      devices=devices, progress=False)
    state = trainer.initial_state()
    memory = {"params_and_optimizer": device_bytes((state.params, state.opt_state)),
              "ema": device_bytes(state.ema) if state.ema is not None else 0,
              "replicated": list(trainer.plan.replicated), "undivided": [list(u) for u in trainer.plan.undivided]}
    losses = []
    for batch in itertools.islice(batches, UPDATES):
        state, metrics = trainer.step(state, batch)
        losses.append(metrics["loss"])
    params = {path: np.asarray(leaf).ravel().tolist() for path, leaf in
              ((jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(state.params))}
    ema_kept = state.ema is None or all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
        zip(jax.tree.leaves(state.ema), jax.tree.leaves(trainer.initial_state().ema)))
    return {"losses": losses, "params": params, "memory": memory, "reference_kept": ema_kept}


def sft():
    rows = np.random.default_rng(0).integers(0, 32, (UPDATES, 8, 13)).astype(np.int32)
    objective = LMObjective(decoder(12), seq_len=12, ema_decay=None)
    return {name: run(objective, ({"text": r} for r in rows), mesh) for name, mesh in MESHES.items()}


def dpo_batches():
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(UPDATES):
        ids = rng.integers(0, 32, (8, 2, 9)).astype(np.int32)
        mask = np.zeros((8, 2, 9), np.int32)
        mask[:, :, 4:] = 1
        batches.append({"input_ids": ids, "completion_mask": mask})
    return batches


def dpo():
    objective = DPOObjective(decoder(8), seq_len=8, beta=0.5)
    return {name: run(objective, iter(dpo_batches()), mesh) for name, mesh in MESHES.items()}


class Recorded:
    """A rollout that keeps each batch it returns, so the other meshes train on the same ones."""

    def __init__(self, rollout):
        self.rollout, self.batches = rollout, []
        self.metrics = {}

    def __call__(self, batch, variables, version, key):
        out = self.rollout(batch, variables, version, key)
        self.batches.append(out)
        return out


def prompts(rows):
    ids = np.random.default_rng(2).integers(3, 32, (rows, 4)).astype(np.int32)
    return {"prompt": ids, "prompt_length": np.full(rows, 4, np.int32),
            "data_source": utf8_column(["toy"] * rows), "ground_truth": utf8_column(["7"] * rows),
            "extra_info": np.zeros((rows, 0), np.int32)}


def sgd():
    return optax.sgd(1e-2)


def grpo():
    # SGD: group-centred advantages leave losses near 0 whose gradients are sums of cancelling terms, and Adam
    # scales an element's small gradient up to a step of the learning rate, last bits included.
    # beta=0: a KL term near its reference is a difference of two nearly equal log-probabilities, whose last bits
    # (which a sum in another order changes) Adam would scale up; DPO above trains against a frozen reference.
    objective = GRPOObjective(decoder(12), seq_len=11)

    def reward(data_source, completion, ground_truth, extra_info):  # the first sampled id's parity: mixed groups
        return float(int(completion.split()[0]) % 2) if completion else 0.0

    sampled = SampledRollout(objective, reward=reward, groups=4, max_new_tokens=8,
                             sampling=Sampling(eos_id=1, temperature=1.0), decode=lambda ids: " ".join(map(str, ids)))
    recorded = Recorded(sampled)
    results = {"replicated": run(objective, itertools.repeat(prompts(2)), None, rollout=recorded, optimizer=sgd)}
    for name, mesh in list(MESHES.items())[1:]:
        results[name] = run(objective, iter(recorded.batches), mesh, optimizer=sgd)
    # The in-process rollout draws from the sharded variables what it draws from the replicated ones.
    start = Trainer(objective, optimizer(), key=jax.random.key(0), parallelism=Parallelism(fsdp=4, tensor=2),
                    progress=False).initial_state()
    again = sampled(prompts(2), start.params, 0, jax.random.key(5))
    once = sampled(prompts(2), jax.device_get(start.params), 0, jax.random.key(5))
    floating = [k for k in once if np.issubdtype(once[k].dtype, np.floating)]
    results["rollout_from_sharded"] = {
        "same_ids": all(np.array_equal(once[k], again[k]) for k in once if k not in floating),
        "float_difference": max(float(np.abs(once[k] - again[k]).max()) for k in floating),
    }
    return results


def ppo():
    # The tool-episode PPO with a critic of tests/test_ppo.py; its episodes split the tasks over the 8 devices.
    ppo = ppo_objective(beta=0.03)
    return {name: run(ppo, itertools.repeat(tasks(*range(8))), mesh, rollout=PPORollout(ppo, rollout(ppo)), key=3)
            for name, mesh in (("replicated", None), ("fsdp 8", Parallelism(fsdp=8)))}


def flow_grpo():
    flow = spec_objective()
    return {name: run(flow, itertools.repeat(source_batch(rows=2)), mesh, key=1, devices=jax.devices()[:2],
                      rollout=FlowRollout(flow, brightness, groups=4, steps=5, devices=jax.devices()[:2]))
            for name, mesh in (("replicated", None), ("fsdp 2", Parallelism(fsdp=2)))}


def checkpoints():
    """A checkpoint written under fsdp 8 restores onto fsdp 4 x tensor 2, and that one's onto one device, alike."""
    objective = DPOObjective(decoder(8), seq_len=8, beta=0.5)
    batch = dpo_batches()[0]
    meshes = [(Parallelism(fsdp=8), None), (Parallelism(fsdp=4, tensor=2), None), (Parallelism(), jax.devices()[:1])]
    values, shardings = [], []
    with tempfile.TemporaryDirectory() as directory:
        for index, (parallelism, devices) in enumerate(meshes):
            trainer = Trainer(objective, optimizer(), key=jax.random.key(0), parallelism=parallelism, devices=devices,
                              progress=False)
            if index == 0:
                state, _ = trainer.step(trainer.initial_state(), batch)
                trainer.save(state, directory)
            else:
                state, _ = trainer.restore(directory)
            leaves = jax.tree.leaves(trainer._plain(state))
            values.append([np.asarray(leaf).tolist() for leaf in leaves])
            shardings.append(sorted({str(leaf.sharding.spec) for leaf in leaves}))
            # the restored state trains on from where the written one stood
            state, metrics = trainer.step(state, batch)
            values[-1].append(metrics["loss"])
    return {"equal": [values[0][:-1] == other[:-1] for other in values[1:]],
            "next_losses": [v[-1] for v in values], "specs": shardings}


def server():
    """The native Server serves variables sharded fsdp 4 x tensor 2 as they are, drawing what host copies draw."""
    model = decoder(32)
    variables = Trainer(LMObjective(model, seq_len=12, ema_decay=None), optimizer(), key=jax.random.key(0),
                        parallelism=Parallelism(fsdp=4, tensor=2), progress=False).initial_state().params
    drawn = []
    for served in (variables, jax.device_get(variables)):
        engine = Server(model, served, Sampling(temperature=1.0, eos_id=1), slots=4, capacity=32)
        for seed in range(4):
            engine.submit([3, 4, 5, 6], 12, seed=seed)
        finished = []
        while engine.busy:
            finished += engine.step()
        drawn.append(sorted((f.request, list(f.ids)) for f in finished))
    return {"same_ids": drawn[0] == drawn[1], "requests": len(drawn[0])}


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["sft", "dpo", "grpo", "ppo", "flow_grpo", "checkpoints", "server"]
    print(json.dumps({name: globals()[name]() for name in chosen}))
