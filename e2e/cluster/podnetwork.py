"""Pod IPs made real on this host: /32 addresses on lo, and an unreachable route for the rest.

kwok hands out pod IPs from each node's podCIDR. A pod whose processes run here gets its IP added
to lo, so it can be bound and reached like a real pod's. The rest of the pod network is routed as
unreachable, so a connection to a pod that runs nothing fails at once, as it would in a cluster,
instead of leaving by the default route (where some networks answer for any address).
Everything here is idempotent, and ``release`` needs only the CIDRs, so it cleans up after crashes.

The pod network is one per machine, so one local cluster at a time may use it: the pod runner
holds an flock on ``LOCK`` for as long as it runs, and the lock dies with it.
"""

import contextlib
import fcntl
import ipaddress
import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

LOCK = Path(tempfile.gettempdir()) / "batchpilot-e2e-podnetwork.lock"


def _acquire() -> IO[str] | None:
    handle = LOCK.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def try_lock(owner: Path) -> IO[str] | None:
    """The locked file (keep it open to hold the lock), or None if another cluster holds it."""
    handle = _acquire()
    if handle is not None:
        handle.truncate(0)
        handle.write(f"{owner}\n")
        handle.flush()
    return handle


def holder() -> str | None:
    """The state dir of the cluster that uses the pod network now, if any."""
    handle = _acquire()
    if handle is not None:
        handle.close()
        return None
    with contextlib.suppress(OSError):
        return LOCK.read_text().strip() or "another cluster"
    return "another cluster"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def add_address(ip: str) -> None:
    result = _ip("addr", "add", f"{ip}/32", "dev", "lo")
    if result.returncode != 0 and "File exists" not in result.stderr:
        raise OSError(f"ip addr add {ip}/32 dev lo: {result.stderr.strip()}")


def remove_address(ip: str) -> None:
    _ip("addr", "del", f"{ip}/32", "dev", "lo")


def addresses_in(cidrs: Sequence[str]) -> list[str]:
    """The /32 addresses on lo that lie in the given networks."""
    networks = [ipaddress.ip_network(cidr) for cidr in cidrs]
    shown = subprocess.run(
        ["ip", "-json", "-4", "addr", "show", "dev", "lo"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [
        info["local"]
        for link in json.loads(shown)
        for info in link.get("addr_info", [])
        if info.get("prefixlen") == 32
        and any(ipaddress.ip_address(info["local"]) in net for net in networks)
    ]


def claim(network: str) -> None:
    result = _ip("route", "replace", "unreachable", network)
    if result.returncode != 0:
        raise OSError(f"ip route replace unreachable {network}: {result.stderr.strip()}")


def release(network: str, cidrs: Sequence[str]) -> list[str]:
    """Remove the route and every pod address; returns the addresses removed."""
    removed = addresses_in(cidrs)
    for ip in removed:
        remove_address(ip)
    _ip("route", "del", "unreachable", network)
    return removed
