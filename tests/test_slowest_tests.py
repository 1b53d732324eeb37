"""tools/slowest_tests.py: the Tests page's table of the slowest tests, from conftest's per-test load log."""

import json

import pytest
from conftest import import_from

slowest = import_from("tools", "slowest_tests")


def test_the_slowest_come_first_with_their_cores_and_group_suffixes_dropped(tmp_path):
    log = tmp_path / "load.jsonl"
    rows = [{"test": "tests/a.py::quick", "wall": 2.0, "busy_cpu": 1.0, "cores_used": 0.5},
            {"test": "tests/b.py::long@engines", "wall": 300.0, "busy_cpu": 450.0, "cores_used": 1.5},
            {"test": "tests/c.py::middle[x]@tests/c.py", "wall": 40.0, "busy_cpu": 80.0, "cores_used": 2.0},
            {"test": "tests/d.py::at[a@b]", "wall": 30.0, "busy_cpu": 0.0, "cores_used": 0.0}]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    lines = slowest.table(slowest.read(log), top=3).splitlines()
    assert lines[2:5] == ["| `tests/b.py::long` | 300 | 1.50 |", "| `tests/c.py::middle[x]` | 40 | 2.00 |",
                          "| `tests/d.py::at[a@b]` | 30 | 0.00 |"]
    # busy CPU seconds over test seconds: (1 + 450 + 80 + 0) / 372
    assert lines[-1] == "4 tests, 6.2 test-minutes over the workers; 1.43 cores busy on average while a test ran."


def test_a_line_that_is_not_a_row_names_its_line(tmp_path):
    log = tmp_path / "load.jsonl"
    log.write_text(json.dumps({"test": "t", "wall": 1.0, "cores_used": 1.0}) + "\n{\"test\": \"u\"}\n")
    with pytest.raises(SystemExit, match=r"load.jsonl:2 is not a load-log row .*cores_used"):
        slowest.read(log)
