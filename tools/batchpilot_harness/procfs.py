"""What Linux's /proc says about a process: its state, parent, group, CPU time and memory; and
making SIGTERM stop a process's own children.

One reader for everything the harness and its users learn about processes: stopping a local
Triton together with the Python stubs it started (`local_triton`), finding and stopping the e2e
cluster's processes (`batchpilot_cluster.processes`), and measuring what a process costs (the
benchmarks). A process that is gone, or not ours to read, reads as None.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stat:
    """The fields of /proc/PID/stat that we read."""

    pid: int
    state: str
    parent: int
    group: int
    cpu_seconds: float
    """User and system time so far, all threads."""

    @property
    def alive(self) -> bool:
        """Neither a zombie waiting to be reaped nor dead."""
        return self.state not in ("Z", "X")


def stat(pid: int) -> Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    # The command name sits in parentheses and may contain anything; the fields follow the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return Stat(
        pid=pid,
        state=fields[0],
        parent=int(fields[1]),
        group=int(fields[2]),
        cpu_seconds=(int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
    )


def is_alive(pid: int) -> bool:
    found = stat(pid)
    return found is not None and found.alive


def pids() -> list[int]:
    """Every process on the machine now."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def group(pgid: int) -> list[Stat]:
    """Every process of a process group, zombies included."""
    return [found for pid in pids() if (found := stat(pid)) is not None and found.group == pgid]


def group_members(pgid: int) -> list[int]:
    """The live processes of a process group."""
    return [found.pid for found in group(pgid) if found.alive]


def children(pid: int) -> set[int]:
    """The live processes `pid` started itself (not their own children): a Triton server's
    Python-backend stubs, which a reload replaces, without the short-lived helpers an engine
    behind a stub starts and ends on its own."""
    return {
        child
        for child in pids()
        if (found := stat(child)) is not None and found.alive and found.parent == pid
    }


def cpu_seconds(pid: int) -> float:
    found = stat(pid)
    if found is None:
        raise ProcessLookupError(f"no process {pid}")
    return found.cpu_seconds


def resident_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE


def raise_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise KeyboardInterrupt, as SIGINT does, so that finally-blocks and
    with-blocks stop what they started (a local Triton, a cluster) instead of orphaning it;
    returns what restores the previous handler. Only the main thread can set one: elsewhere a
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def mount_options(pid: int, mount_point: str) -> list[str] | None:
    """The options of what is mounted at `mount_point` in the process's mount namespace (the
    last mount there: the one it sees), from /proc/PID/mountinfo; None if nothing is."""
    try:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split()
        # id, parent, major:minor, root, mount point, options, ...
        if len(fields) > 5 and fields[4] == mount_point:
            found = fields[5].split(",")
    return found
