"""Start, find and stop the cluster's processes, including after a crash.

Every process is started in a session (and so a process group) of its own, so that stopping it
also stops whatever it spawned, and with ``BATCHPILOT_E2E_OWNER=<state dir>`` in its environment,
which its children inherit. Pid files are only a hint: pids get reused, so nothing is signalled
unless /proc shows that it carries the owner mark, or is one of our binaries and names the state dir
on its command line (a `tail -f` of a log does that too, and must survive). ``sweep`` relies on
that alone and so also cleans up after a run whose pid files are gone.
"""

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from batchpilot_cluster import locations
from batchpilot_harness import procfs

OWNER_ENV = "BATCHPILOT_E2E_OWNER"

# Children started by this process, kept so that they can be reaped when stopped: a dropped
# Popen of a running child warns, and an unreaped one lingers as a zombie.
_children: dict[int, subprocess.Popen[bytes]] = {}


def owner_mark(state_dir: Path) -> bytes:
    return f"{OWNER_ENV}={state_dir}".encode()


def start(
    *,
    name: str,
    argv: Sequence[str],
    state_dir: Path,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ if env is None else env)
    environment[OWNER_ENV] = str(state_dir)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=cwd,
            start_new_session=True,
        )
    pid_dir = state_dir / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"{name}.pid").write_text(f"{process.pid}\n")
    (pid_dir / f"{name}.json").write_text(
        json.dumps({"argv": list(argv), "log_path": str(log_path), "cwd": cwd and str(cwd)})
    )
    _children[process.pid] = process
    return process


def restart(
    state_dir: Path,
    name: str,
    *,
    down_seconds: float = 0.0,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Stop a component (SIGTERM, then SIGKILL) and, `down_seconds` later, start it again as
    it was started (in `env`, if it was not started in this process's environment): a crashed
    or upgraded process coming back."""
    recorded = json.loads((state_dir / "pids" / f"{name}.json").read_text())
    stop_recorded(state_dir, [name])
    time.sleep(down_seconds)
    cwd = recorded["cwd"]
    return start(
        name=name,
        argv=recorded["argv"],
        state_dir=state_dir,
        log_path=Path(recorded["log_path"]),
        env=env,
        cwd=Path(cwd) if cwd else None,
    )


def reap(pids: Sequence[int], *, timeout: float = 5.0) -> None:
    """Collect the exit status of those pids that are our own children and have exited.

    Waits a little: a multi-threaded process shows as a zombie in /proc while its other
    threads still exit, and cannot be reaped until they have.
    """
    for pid in pids:
        child = _children.get(pid)
        if child is None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=timeout)
            del _children[pid]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def is_owned(pid: int, state_dir: Path) -> bool:
    if owner_mark(state_dir) in _read(Path(f"/proc/{pid}/environ")).split(b"\0"):
        return True
    if str(state_dir).encode() not in _read(Path(f"/proc/{pid}/cmdline")):
        return False
    try:
        executable = Path(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return executable.parent == locations.bin_dir()


def other_owners(state_dir: Path) -> set[str]:
    """The state dirs of other runs that have live processes on this machine: a cluster that
    is starting holds no lock yet, but its processes carry their owner mark from the first."""
    prefix = f"{OWNER_ENV}=".encode()
    owners = set()
    for pid in procfs.pids():
        for entry in _read(Path(f"/proc/{pid}/environ")).split(b"\0"):
            if entry.startswith(prefix):
                owner = entry.removeprefix(prefix).decode(errors="replace")
                if owner != str(state_dir) and procfs.is_alive(pid):
                    owners.add(owner)
    return owners


def protected_pids() -> set[int]:
    """This process and its ancestors: a `down` run from inside the tree must not kill itself."""
    protected = set()
    pid = os.getpid()
    while pid > 1:
        protected.add(pid)
        found = procfs.stat(pid)
        if found is None:
            break
        pid = found.parent
    return protected


def owned_pids(state_dir: Path) -> list[int]:
    protected = protected_pids()
    return [
        pid
        for pid in procfs.pids()
        if pid not in protected and procfs.is_alive(pid) and is_owned(pid, state_dir)
    ]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_gone(pids: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(procfs.is_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return not any(procfs.is_alive(pid) for pid in pids)


def stop_group(pid: int, *, state_dir: Path, timeout: float = 10.0) -> None:
    """SIGTERM the process group led by pid, then SIGKILL whatever outlives the timeout."""
    stop_groups({pid: timeout}, state_dir=state_dir)


def stop_groups(timeouts: Mapping[int, float], *, state_dir: Path) -> None:
    """SIGTERM the process groups led by these pids at once, as a kubelet stops a Pod's
    containers, then SIGKILL each group that outlives its own timeout (pid -> seconds)."""
    started = time.monotonic()
    members: dict[int, list[int]] = {}
    for pid in timeouts:
        if procfs.is_alive(pid) and is_owned(pid, state_dir):
            members[pid] = procfs.group_members(pid) or [pid]
            _signal_group(pid, signal.SIGTERM)
    for pid in sorted(members, key=lambda pid: timeouts[pid]):
        left = started + timeouts[pid] - time.monotonic()
        if not _wait_gone(members[pid], max(left, 0.0)):
            _signal_group(pid, signal.SIGKILL)
            _wait_gone(members[pid], 5.0)
    reap([member for group in members.values() for member in group])


def stop_recorded(state_dir: Path, names: Sequence[str], *, timeout: float = 10.0) -> None:
    """Stop the components named, in the order given, by their pid files."""
    for name in names:
        pid_file = state_dir / "pids" / f"{name}.pid"
        text = _read(pid_file).decode().strip()
        if text.isdigit():
            stop_group(int(text), state_dir=state_dir, timeout=timeout)


def sweep(state_dir: Path, *, timeout: float = 5.0) -> list[int]:
    """Terminate every remaining process that belongs to this state dir; returns their pids."""
    leftovers = owned_pids(state_dir)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    if not _wait_gone(leftovers, timeout):
        for pid in leftovers:
            if procfs.is_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        _wait_gone(leftovers, 5.0)
    reap(leftovers)
    return leftovers
