"""How a two-process test worker (``WORKER SCENARIO PROCESS PORT OUT``) runs and ends, and the data it reads.

A failure prints its traceback (after ``on_failure``, which may print what a test checks)
and leaves with os._exit(1): a normal exit would run jax.distributed's shutdown barrier,
which waits for a peer that may already be gone. A scenario other than "reference" (which
trains alone) shuts jax.distributed down after a success.
"""

import itertools
import os
import sys
import traceback

import numpy as np


def task_rows(partition, dtype=np.int32):
    """The workers' global data, task ids [4k .. 4k + 3] at step k, of which this partition reads its rows."""
    for step in itertools.count():
        rows = 4 // partition.count
        ids = np.arange(4 * step, 4 * step + 4)[partition.index * rows:(partition.index + 1) * rows]
        yield {"task_id": ids.astype(dtype)}


def run_job(main, on_failure=None) -> None:
    scenario, process, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    try:
        main(scenario, process, port, out)
    except BaseException:
        if on_failure is not None:
            on_failure()
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if scenario != "reference":
        import jax

        jax.distributed.shutdown()
