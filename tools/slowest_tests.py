"""The slowest tests of a run, from its per-test load log, as the Tests page's table.

A run with ``DEW_TEST_LOAD_LOG=PATH`` (tests/conftest.py) appends one JSON line per test: its wall seconds and the
machine's busy CPU seconds over them, every process's (the other worker's, Ray's and the engines' included), so
``cores used`` is the whole machine's load while the test ran, not the test's own.

    uv run python tools/slowest_tests.py /tmp/load.jsonl --top 15
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def read(path: Path) -> list[dict]:
    """The log's rows; a line that is not a test's row names its line number."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            # pytest-xdist appends a test's group to its node id ("...::test_x@engines", "...[sft]@tests/test_y.py"):
            # the table names the test (an "@" inside a parameter's brackets stays)
            test = re.sub(r"@[^@\]]*$", "", str(row["test"]))
            rows.append({"test": test, "wall": float(row["wall"]), "cores": float(row["cores_used"])})
        except (ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"{path}:{number} is not a load-log row (test, wall, cores_used): {error}") from None
    return rows


def table(rows: list[dict], top: int) -> str:
    """The ``top`` slowest rows as a markdown table, and a line with the run's totals."""
    slowest = sorted(rows, key=lambda row: row["wall"], reverse=True)[:top]
    lines = ["| test | seconds | cores used (of the machine's, all processes) |", "| --- | --- | --- |"]
    lines += [f"| `{row['test']}` | {row['wall']:.0f} | {row['cores']:.2f} |" for row in slowest]
    total = sum(row["wall"] for row in rows)
    busy = sum(row["wall"] * row["cores"] for row in rows)
    lines.append(f"\n{len(rows)} tests, {total / 60:.1f} test-minutes over the workers; "
                 f"{busy / max(total, 1e-9):.2f} cores busy on average while a test ran.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the file DEW_TEST_LOAD_LOG named")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be at least 1, got {args.top}")
    print(table(read(args.log), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
