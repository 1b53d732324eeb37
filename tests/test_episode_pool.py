"""EpisodeRollout on a two-process CPU trainer (gloo): parity with one process on two devices, failures on all ranks.

Each scenario runs tests/workers/episode_worker.py (see its docstring) as two real
``jax.distributed`` processes with one CPU device each; the reference is one process
holding two CPU devices, on the same global task rows.
"""

import json

import numpy as np
import pytest
from conftest import ROOT, finish_workers, launch_workers

WORKER = str(ROOT / "tests" / "workers" / "episode_worker.py")


@pytest.mark.slow
def test_two_processes_collect_and_train_as_one_process_holding_two_devices(tmp_path):
    pair = launch_workers(WORKER, "parity", tmp_path)
    reference = launch_workers(WORKER, "reference", tmp_path, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                       processes=(0,))
    results = finish_workers(pair + reference)
    for code, output, _ in results:
        assert code == 0, output
    first, second, alone = (json.loads(path.read_text()) for _, _, path in results)
    # the ranks' episodes took different numbers of turns, yet each drew what the one process drew for its rows
    for mine, theirs, whole in zip(first["records"], second["records"], alone["records"], strict=True):
        assert mine + theirs == whole  # every rollout call: each rank's records are the one process's, in order
    turns = [[max(len(r["tokens"]) for r in call) for call in got["records"]] for got in (first, second)]
    assert turns[0] != turns[1], turns  # in some call one rank ran more rounds of episodes than the other
    for step, (mine, theirs, whole) in enumerate(zip(first["projected"], second["projected"], alone["projected"])):
        if whole is None:
            assert mine is None and theirs is None, step
            continue
        for name, value in whole.items():  # each process's rows are its half of the one process's batch
            np.testing.assert_array_equal(np.asarray(mine[name] + theirs[name]), np.asarray(value), err_msg=name)
    assert first["updates"] == second["updates"] == alone["updates"] >= 2
    for got in (first, second):
        for a, b in zip(got["params"], alone["params"], strict=True):
            np.testing.assert_array_equal(a, b)  # bit for bit: the same batch, the same sharded update
        assert got["released"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario, own, others", [
    ("tool_failure", "RuntimeError: the square tool crashed",
     "round 1 of the episodes failed on process 1 of 2 (process 1: RuntimeError: the square tool crashed)"),
    ("mismatch", "the episode cohort differs across processes: options", None),
])
def test_a_failure_on_one_rank_ends_every_rank_and_releases_what_each_opened(tmp_path, scenario, own, others):
    results = finish_workers(launch_workers(WORKER, scenario, tmp_path))
    for process, (code, output, path) in enumerate(results):
        assert code != 0 and not path.exists(), output
        assert (own if process == 1 or others is None else others) in output, output
        released = json.loads(next(line for line in output.splitlines() if line.startswith("RELEASED "))[9:])
        assert released["opened"] == released["closed"], output
        if scenario == "tool_failure":
            assert released["opened"] == 8  # every environment of the rank's two tasks, four samples each
        else:
            assert released["opened"] == 0  # refused before any environment opened
