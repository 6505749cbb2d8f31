"""What /proc says about processes: this one, a zombie child, and one that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from batchpilot_harness import procfs


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child of this process that has exited and is not reaped yet, in a group of its own."""
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    deadline = time.monotonic() + 10
    while (found := procfs.stat(child.pid)) is None or found.alive:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    yield child.pid
    child.wait()


def test_group_members_include_this_process() -> None:
    assert os.getpid() in procfs.group_members(os.getpgid(0))


def test_stat_of_this_process_names_its_parent_group_and_state() -> None:
    found = procfs.stat(os.getpid())

    assert found is not None
    assert (found.parent, found.group, found.alive) == (os.getppid(), os.getpgid(0), True)
    assert found.cpu_seconds > 0


def test_zombie_is_in_its_group_but_not_among_its_live_members(zombie: int) -> None:
    assert [found.pid for found in procfs.group(zombie)] == [zombie]
    assert procfs.group_members(zombie) == []
    assert not procfs.is_alive(zombie)


def test_process_that_is_gone_reads_as_none(zombie: int) -> None:
    os.waitpid(zombie, 0)

    assert procfs.stat(zombie) is None
    assert not procfs.is_alive(zombie)
    with pytest.raises(ProcessLookupError):
        procfs.cpu_seconds(zombie)


def test_resident_memory_of_this_process_is_megabytes() -> None:
    assert procfs.resident_bytes(os.getpid()) > 1_000_000


@pytest.mark.timeout(30)
def test_children_are_the_processes_it_started_not_their_own() -> None:
    """A parent that starts a grandchild: the parent's children are the child alone."""
    sleeper = "import time; time.sleep(30)"
    script = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (grandchildren := procfs.children(child.pid)):
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.01)
        assert procfs.children(os.getpid()) >= {child.pid}
        assert child.pid not in grandchildren
        assert procfs.children(child.pid).isdisjoint(procfs.children(os.getpid()))
    finally:
        os.killpg(child.pid, 9)
        child.wait()


def test_mount_options_name_what_a_process_sees_mounted_and_none_elsewhere() -> None:
    own = os.getpid()
    root = procfs.mount_options(own, "/")
    assert root is not None
    assert {"rw", "ro"} & set(root)
    proc = procfs.mount_options(own, "/proc")
    assert proc is not None
    assert {"rw", "ro"} & set(proc)
    assert procfs.mount_options(own, "/no/such/mount/point") is None
    assert procfs.mount_options(2**22 + 1, "/") is None  # past pid_max: no such process
