"""What the two-process publish workers share: the two pushes they record, and how they leave.

A worker leaves with ``os._exit``: a normal exit would run jax.distributed's shutdown
barrier, which waits for a peer that may already be gone.
"""

import json
import os
import sys
import traceback


def publish_twice(publication, variables, out: str, **extra) -> None:
    """Load version 1 (which must land), then version 2, and write what each process saw to ``out``:
    ``{"after_first", "second" ("Type: message" or null), "version", **extra}``."""
    publication.load(variables, 1)
    after_first = publication.version
    second = None
    try:
        publication.load(variables, 2)
    except Exception as error:  # the outcome every process must agree on
        second = f"{type(error).__name__}: {error}"
    with open(out, "w") as file:
        json.dump({"after_first": after_first, "second": second, "version": publication.version,
                   **{key: value() for key, value in extra.items()}}, file)


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
