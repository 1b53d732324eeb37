"""dew.hugepages: the glibc tunable that gives XLA's large CPU allocations transparent huge pages."""

import subprocess
import sys

from dew.hugepages import VARIABLE, hugepage_environment, started_with_hugepages, with_hugepages


def test_the_tunable_is_added_to_what_is_there_and_a_users_own_value_is_kept():
    assert with_hugepages(None) == "glibc.malloc.hugetlb=1"
    assert with_hugepages("") == "glibc.malloc.hugetlb=1"
    assert with_hugepages("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert with_hugepages("glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2") == (
        "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2")  # the user turned it off: dew does not override it
    assert hugepage_environment({VARIABLE: "glibc.malloc.arena_max=2"}) == {
        VARIABLE: "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


def test_a_process_knows_whether_it_was_started_with_huge_pages(tmp_path):
    environ = tmp_path / "environ"
    environ.write_bytes(b"HOME=/root\0GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1\0")
    assert started_with_hugepages(environ)
    environ.write_bytes(b"HOME=/root\0GLIBC_TUNABLES=glibc.malloc.hugetlb=0\0")
    assert not started_with_hugepages(environ)
    environ.write_bytes(b"HOME=/root\0")
    assert not started_with_hugepages(environ)
    assert not started_with_hugepages(tmp_path / "missing")


def test_the_environment_reaches_a_started_process_at_exec():
    check = "from dew.hugepages import started_with_hugepages; print(started_with_hugepages())"
    base = {"PATH": "/usr/bin:/bin"}
    started = subprocess.run([sys.executable, "-c", check], env={**base, **hugepage_environment(base)},
                             capture_output=True, text=True, check=True)
    assert started.stdout.strip() == "True"
    plain = subprocess.run([sys.executable, "-c", check], env=base, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "False"
