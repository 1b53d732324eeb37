"""Provide the headless browser the documentation test renders the built site in: Debian's ``chromium``.

    uv run python tools/browser_env.py          # install chromium if missing (apt-get, as root); print its path

``.ci/run`` runs it before the tests; ``tests/test_docs.py`` runs the same step (``ensure``) and fails naming it
when it cannot be done, never skipping. Any Chromium or Chrome already on PATH is used as it is.
"""

from __future__ import annotations

import shutil
import sys

from container_env import ContainerEngineError, apt_install

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find() -> str | None:
    """The first Chromium or Chrome on PATH, or None."""
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def ensure() -> str:
    """A headless-capable Chromium's path, installed from Debian's packages when none is on PATH."""
    found = find()
    if found is None:
        apt_install(["chromium"], "a headless browser for the documentation test",
                    "or put any Chromium or Chrome on PATH")
        found = find()
    if found is None:
        raise ContainerEngineError("installing a headless browser: apt-get installed chromium, but no chromium is on "
                                   "PATH")
    return found


def main() -> int:
    try:
        print(ensure())
    except ContainerEngineError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
