import json

import pytest

from conftest import free_port, run_python

EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

TRAIN = """
import itertools, json, sys
import jax, numpy as np, optax
from dew import Dataset, Trainer, models
from dew.objectives import LMObjective

model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=2, num_heads=2,
                     mlp_features=32, max_seq_len=12)
GLOBAL = np.random.default_rng(0).integers(0, 32, (8, 13)).astype(np.int32)

def trainer(devices=None, parallelism=None):
    objective = LMObjective(model, seq_len=12, ema_decay=None)
    # eps=1e-5: with 1e-8, Adam turns the last-bit difference of a near-zero gradient summed in another order
    # into a step of up to the learning rate (tests/workers/sharded_training.py says more)
    return Trainer(objective, optax.adam(1e-3, eps=1e-5), key=jax.random.key(0), devices=devices, parallelism=parallelism,
                   progress=False)
"""


def test_one_device_equals_eight_devices():
    result = run_python(
        TRAIN
        + """
assert jax.device_count() == 8
losses = {}
for name, devices in (("one", jax.devices()[:1]), ("eight", jax.devices())):
    t = trainer(devices)
    state = t.initial_state()
    losses[name] = []
    for step in range(4):
        state, metrics = t.step(state, {"text": GLOBAL})
        losses[name].append(metrics["loss"])
    leaves = jax.tree.leaves(state.params)
    assert len(leaves[0].sharding.device_set) == len(devices)
    losses[name + "_params"] = [np.asarray(x).tolist() for x in leaves]
try:
    trainer().step(trainer().initial_state(), {"text": GLOBAL[:6]})
except ValueError as error:
    losses["error"] = str(error)
print(json.dumps(losses))
""",
        env=EIGHT_DEVICES,
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["one"] == pytest.approx(out["eight"], abs=1e-5)
    assert out["one"][-1] < out["one"][0]
    import numpy as np

    for a, b in zip(out["one_params"], out["eight_params"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert out["error"] == "a batch of 6 rows does not divide across 8 devices; use a batch size that is a multiple of 8"


WORKER = (
    TRAIN
    + """
from dew.parallelism import Parallelism
from dew.sharding import collective_host, initialize_processes
process, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
partition = initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=4)
assert (partition.index, partition.count, jax.device_count(), jax.local_device_count()) == (process, 2, 8, 4)

def train(partition):
    rows = len(GLOBAL) // partition.count  # each process reads only its own rows of the global batch
    mine = {"text": GLOBAL[partition.index * rows:(partition.index + 1) * rows]}
    return itertools.repeat(mine)

# one 8-device FSDP mesh over both processes: each holds an eighth of every sharded leaf on each of its devices
state = trainer(parallelism=Parallelism(fsdp=8)).fit(Dataset(train=train, batch=8), steps=3, log_every=3)
kernel = state.params["params"]["layers_0"]["mlp"]["up_proj"]["kernel"]
assert not kernel.is_fully_addressable and kernel.addressable_shards[0].data.shape == (2, 32), kernel.sharding
params = [np.asarray(x).tolist() for x in jax.tree.leaves(collective_host(state.params))]
json.dump(params, open(out, "w"))
jax.distributed.shutdown()
"""
)


@pytest.mark.slow
def test_two_processes_of_four_devices_form_one_fsdp_mesh_equal_to_one_process(tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    import numpy as np

    from conftest import ROOT

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WORKER), str(rank), str(port), str(tmp_path / f"{rank}.json")],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    for worker, output in zip(workers, outputs):
        assert worker.returncode == 0, output
    # The reference is one process holding eight devices on the same FSDP mesh: the same global batch split the
    # same way, so only the process boundary (gloo instead of in-process collectives) differs.
    single = run_python(
        TRAIN
        + """
from dew.parallelism import Parallelism
assert jax.process_count() == 1 and jax.device_count() == 8
state = trainer(parallelism=Parallelism(fsdp=8)).fit(Dataset(train=lambda p: itertools.repeat({"text": GLOBAL}), batch=8),
                                                     steps=3, log_every=3)
print(json.dumps([np.asarray(x).tolist() for x in jax.tree.leaves(state.params)]))
""",
        env=EIGHT_DEVICES,
    )
    reference = json.loads(single.stdout.strip().splitlines()[-1])
    for rank in range(2):
        params = json.loads((tmp_path / f"{rank}.json").read_text())
        for a, b in zip(params, reference, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


BAD_BATCH_WORKER = (
    TRAIN
    + """
from dew.sharding import initialize_processes
process, port = int(sys.argv[1]), sys.argv[2]
partition = initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=1)
rows = GLOBAL[process * 4:(process + 1) * 4]
# process 1 reads a batch whose ids are floats: only its own check can see it
batch = {"text": rows.astype(np.float32) if process == 1 else rows}
try:
    trainer().fit(Dataset(train=lambda p: itertools.repeat(batch), batch=8), steps=1, log_every=1)
except Exception as error:
    print("raised:", type(error).__name__, str(error).splitlines()[0], flush=True)
    import os
    os._exit(3)  # no shutdown barrier: the point is that neither process waits in a collective
"""
)


def test_a_bad_batch_on_one_process_raises_on_every_process():
    import os
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(BAD_BATCH_WORKER), str(rank), str(port)], env=env,
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [3, 3], outputs
    assert "raised: RuntimeError checking the batch of step 1 failed on process 1 of 2" in outputs[0], outputs[0]
    assert "raised: " in outputs[1] and "text" in outputs[1], outputs[1]


def test_coordinator_ports_come_from_outside_the_ephemeral_range(monkeypatch):
    """A port from bind(0) is one the kernel also gives outgoing connections, which once took a coordinator's."""
    import socket

    from dew.inference import engines

    ephemeral_low = int(engines.EPHEMERAL_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(8)}
    assert all(engines.LISTEN_PORTS[0] <= port < ephemeral_low for port in ports), ports
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # still free
    # every listening port taken: it falls back to one the kernel picks
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        monkeypatch.setattr(engines, "LISTEN_PORTS", (held, held))
        monkeypatch.setattr(engines, "EPHEMERAL_RANGE", engines.Path("/nonexistent"))
        assert engines.free_port() != held
