"""How a two-process worker leaves: ``os._exit`` with its outcome, since a normal exit would run
jax.distributed's shutdown barrier, which waits for a peer that may already be gone."""

import os
import sys
import traceback


def run_and_exit(main) -> None:
    """``main(PROCESS, *rest)`` from the command line, then exit 0, or print the traceback and exit 1."""
    try:
        main(int(sys.argv[1]), *sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
