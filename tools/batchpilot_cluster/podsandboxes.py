"""The real node's Pods seen from the host, by Pod IP: their processes and their link.

containerd gives each Pod sandbox a network namespace of its own (mounted under its state dir,
not in ``ip netns``), holding the Pod IP on ``eth0``, one end of a veth whose other end is a port
of the node's bridge. Tests find a Pod's processes (to kill its Triton, to stop its sidecar) by
the namespace that holds its IP, and cut a Pod off the network by taking the host end of its
veth down: the Pod keeps its address and routes, what is sent to it gets no answer, and bringing
the link up again heals it.
"""

import itertools
import json
import os
import subprocess
from pathlib import Path

PROC = Path("/proc")


class SandboxError(Exception):
    pass


def _holds(fib_trie: str, ip: str) -> bool:
    """Whether a network namespace's /proc/net/fib_trie lists `ip` as one of its own addresses."""
    lines = [line.strip() for line in fib_trie.splitlines()]
    return any(
        line == f"|-- {ip}" and following.startswith("/32 host LOCAL")
        for line, following in itertools.pairwise(lines)
    )


def _namespaces(proc: Path = PROC) -> dict[str, list[int]]:
    """Every process's network namespace: pids by namespace identity (net:[inode])."""
    found: dict[str, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            identity = os.readlink(entry / "ns" / "net")
        except OSError:  # gone, or a kernel thread
            continue
        found.setdefault(identity, []).append(int(entry.name))
    return found


def pids(ip: str, *, proc: Path = PROC) -> list[int]:
    """The processes in the network namespace that holds `ip` (the host's own excluded)."""
    host = os.readlink(proc / "self" / "ns" / "net")
    for identity, members in _namespaces(proc).items():
        if identity == host:
            continue
        for pid in members:
            try:
                trie = (proc / str(pid) / "net" / "fib_trie").read_text()
            except OSError:
                continue
            if _holds(trie, ip):
                return sorted(members)
            break  # one reading per namespace
    return []


def host_link(ip: str) -> str:
    """The host end of the veth of the Pod at `ip`."""
    members = pids(ip)
    if not members:
        raise SandboxError(f"no network namespace holds {ip}")
    inside = _ip_json("nsenter", f"--net=/proc/{members[0]}/ns/net", "ip", "-j", "link", "show",
                      "dev", "eth0")  # fmt: skip
    peer = inside[0].get("link_index")
    if peer is None:
        raise SandboxError(f"eth0 of the Pod at {ip} is not a veth")
    (link,) = [link for link in _ip_json("ip", "-j", "link", "show") if link["ifindex"] == peer]
    return str(link["ifname"])


def _ip_json(*argv: str) -> list[dict[str, object]]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise SandboxError(f"{' '.join(argv)}: {done.stderr.strip()}")
    shown = json.loads(done.stdout or "[]")
    assert isinstance(shown, list)
    return shown


def _set_link(name: str, state: str) -> None:
    done = subprocess.run(["ip", "link", "set", "dev", name, state], capture_output=True,
                          text=True, timeout=10)  # fmt: skip
    if done.returncode != 0:
        raise SandboxError(f"ip link set dev {name} {state}: {done.stderr.strip()}")


def cut(ip: str) -> str:
    """Cut the Pod at `ip` off the network, as a failed link would; the link, for `restore`."""
    link = host_link(ip)
    _set_link(link, "down")
    return link


def restore(link: str) -> None:
    _set_link(link, "up")
