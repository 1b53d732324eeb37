"""RolloutScheduler on a two-process CPU trainer (gloo): parity with one process, and failures that stop both.

Each scenario runs tests/workers/scheduler_worker.py (see its docstring) as two real
``jax.distributed`` processes with one CPU device each.
"""

import json

import numpy as np
import pytest

from conftest import ROOT, finish_workers, launch_workers

WORKER = str(ROOT / "tests" / "workers" / "scheduler_worker.py")
TIMEOUT = 300  # seconds; generous, the machine may be shared, and a hang must still end the test


def launch(scenario, tmp_path, env=None, processes=(0, 1)):
    return launch_workers(WORKER, scenario, tmp_path, env, processes)


def finish(started):
    return finish_workers(started, TIMEOUT)


@pytest.mark.slow
def test_two_processes_train_as_one_process_holding_two_devices(tmp_path):
    """Each process packs its own 2 rows; one process with two devices packs the same 4 rows at once.

    Step 1 leaves process 1 with no trainable row (it sends 2 masked rows), step 2 leaves
    none anywhere (both skip): 4 steps, 3 updates, pushes of versions 0, 1 and 2. The
    sessions of one index differ in length between the processes, so a session_index
    that collided across them would change the session-mean loss.
    """
    pair = launch("parity", tmp_path)
    reference = launch("reference", tmp_path, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                       processes=(0,))
    results = finish(pair + reference)
    for code, output, _ in results:
        assert code == 0, output
    first, second, alone = (json.loads(path.read_text()) for _, _, path in results)
    for got in (first, second):
        for a, b in zip(got["params"], alone["params"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        assert got["updates"] == alone["updates"] == 3
        assert got["served_version"] == alone["served_version"] == 2  # every process sees the same version
        assert got["pushed"] == alone["pushed"] == [True, True, True, False]
        assert got["admitted"] == [2, 2, 2, 2] and alone["admitted"] == [4, 4, 4, 4]
    # push="one": process 0 sent each push once, the same trees one process sends; process 1 sent none.
    assert [version for version, _ in first["loads"]] == [0, 1, 2]
    assert first["loads"] == alone["loads"]
    assert second["loads"] == [] and second["weights_version"] == -1


@pytest.mark.slow
@pytest.mark.parametrize("scenario, failing, own, others", [
    # process 1's source raises; process 0 has admitted its own groups and waits to rescore with it
    ("admission", 1, "RuntimeError: harness crashed on task 2",
     "RuntimeError: rollout admission for update 0 failed on process 1 of 2 "
     "(process 1: RuntimeError: harness crashed on task 2); every process stops here"),
    # process 0's engine refuses the first push; process 1 only waits for the outcome
    ("push", 0, "ConnectionError: engine unreachable while loading version 0",
     "RuntimeError: the weight push for version 0 failed on process 0 of 2 "
     "(process 0: ConnectionError: engine unreachable while loading version 0); every process stops here"),
    # push="each": process 1's own server never moves; both retry once, then both raise the same error
    ("stuck", 1, "RuntimeError: pushing weights for version 0 left the served version at -1 on process 1 "
     "(was -1) after two tries", None),
])
def test_a_failure_on_one_process_raises_on_both(tmp_path, scenario, failing, own, others):
    results = finish(launch(scenario, tmp_path))
    for process, (code, output, path) in enumerate(results):
        assert code != 0 and not path.exists(), output
        expected = own if process == failing or others is None else others
        assert expected in output, output
    if others is not None:
        assert "every other process raises too" in results[failing][1]


@pytest.mark.slow
def test_each_process_pushes_to_its_own_native_server(tmp_path):
    """push="each": both NativeRolloutServers load every version, and the processes agree on it."""
    results = finish(launch("native", tmp_path))
    for code, output, _ in results:
        assert code == 0, output
    first, second = (json.loads(path.read_text()) for _, _, path in results)
    for got in (first, second):
        assert got["updates"] == 2 and got["pushed"] == [True, True] and got["admitted"] == [2, 2]
        assert got["weights_version"] == got["served_version"] == 1  # launched at -1, pushed 0 and 1
    assert [version for version, _ in first["loads"]] == [0, 1]
    assert first["loads"] == second["loads"]  # each server loaded the same gathered trees
    for a, b in zip(first["params"], second["params"], strict=True):
        np.testing.assert_array_equal(a, b)
