"""How a two-process test worker (``WORKER SCENARIO PROCESS PORT OUT``) runs and ends.

A failure prints its traceback (after ``on_failure``, which may print what a test checks)
and leaves with os._exit(1): a normal exit would run jax.distributed's shutdown barrier,
which waits for a peer that may already be gone. A scenario other than "reference" (which
trains alone) shuts jax.distributed down after a success.
"""

import os
import sys
import traceback


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
