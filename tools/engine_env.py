"""Build (once) and locate the virtual environment a real inference engine runs from.

    uv run python tools/engine_env.py vllm          # build it if missing, print its python
    uv run python tools/engine_env.py vllm --check  # exit 1 when it is not built

The environment lives under ``$DEW_ENGINE_HOME`` or ``~/.cache/dew-ray/engines`` and is
reused between runs; the recipe and the location are ``dew.inference.engines``'s (the
tests and ``VLLMEngine`` read the same place). ``.ci/run`` runs this before the tests.
"""

from __future__ import annotations

import argparse
import sys
import time

from dew.inference.engines import RECIPES, build_engine_env, engine_dir, engine_python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(RECIPES))
    parser.add_argument("--check", action="store_true", help="only report whether it is built")
    args = parser.parse_args(argv)
    python = engine_python(args.engine)
    if args.check or python is not None:
        print(python if python else f"the {args.engine} engine environment is not built ({engine_dir(args.engine)})")
        return 0 if python else 1
    started = time.monotonic()
    print(f"building the {args.engine} engine environment in {engine_dir(args.engine)} (a few minutes, once)", flush=True)
    python = build_engine_env(args.engine)
    print(f"{args.engine} engine environment ready in {time.monotonic() - started:.0f} s: {python}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
