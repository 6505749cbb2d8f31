"""Pod IPs made real on this host: a network namespace per Pod, joined to the host by a veth pair.

kwok hands out pod IPs from each node's podCIDR. A Pod whose processes run here gets a network
namespace of its own (``bpe2e-10-88-0-7``) holding its IP on ``eth0`` and a loopback, like a
container's; its processes run inside it (``ip netns exec``) and listen on 0.0.0.0. The host end
of the veth (``bpe0a580007``: the IP in hex) carries ``GATEWAY``, a link-local address every
namespace routes through, and a /32 route to the Pod IP, so the operator on the host reaches Pods
as it would across a cluster network. Inside, only the pod network and the Service range are
routed (through the gateway): there is no default route, and the forward rule below drops
anything that would leave the machine, so nothing a Pod sends goes beyond the run's own hosts.

Clients that must go through Services get a namespace of the same kind (``client_host``),
from ``CLIENT_NETWORK``, which is in the pod network (clients are Pods to kube-proxy, so their
connections are not masqueraded) but outside every node's podCIDR.

The rest of the pod network, and the Service range, are routed as unreachable, so a connection
to a Pod that runs nothing, or to a Service kube-proxy has no rules for, fails at once instead of
leaving by the default route. The host forwards between the veths
(``net.ipv4.ip_forward``, restored at ``release``); the table ``inet batchpilot-e2e`` drops
whatever would be forwarded between a veth and any other interface. ``release`` needs nothing but
the names' prefix, so it also cleans up after a crashed run: namespaces, veths, the table,
kube-proxy's tables, the routes and the sysctl.

The pod network is one per machine, so one local cluster at a time may use it: the cluster's
``podnetwork-lock`` component (``hold_lock``) holds an flock on ``LOCK`` for as long as it runs,
and the lock dies with it.
"""

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

LOCK = Path(tempfile.gettempdir()) / "batchpilot-e2e-podnetwork.lock"
CLIENT_LOCKS = Path(tempfile.gettempdir()) / "batchpilot-e2e-clients"
FORWARDING_SAVED = Path(tempfile.gettempdir()) / "batchpilot-e2e-ip-forward"
"""The host's net.ipv4.ip_forward before the first claim, restored by release."""

NETNS_PREFIX = "bpe2e-"
LINK_PREFIX = "bpe"
GATEWAY = "169.254.1.1"
"""The host's address on every veth: each namespace's next hop."""
CLIENT_NETWORK = ipaddress.ip_network("10.88.255.0/24")
"""Client hosts: in the pod network, outside every node's podCIDR (nodes take 10.88.0-254)."""
FILTER_TABLE = "batchpilot-e2e"
KUBE_PROXY_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))
"""What kube-proxy's nftables mode leaves behind when it is killed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Host:
    """One namespace of the run: a Pod's or a client's."""

    ip: str

    @property
    def netns(self) -> str:
        return NETNS_PREFIX + self.ip.replace(".", "-")

    @property
    def link(self) -> str:
        """The host end of its veth pair (15 characters at most, as Linux wants)."""
        return LINK_PREFIX + ipaddress.IPv4Address(self.ip).packed.hex()

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv`, run inside the namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


# -- the machine-wide lock


def _acquire(path: Path) -> IO[str] | None:
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def try_lock(owner: Path) -> IO[str] | None:
    """The locked file (keep it open to hold the lock), or None if another cluster holds it."""
    handle = _acquire(LOCK)
    if handle is not None:
        handle.truncate(0)
        handle.write(f"{owner}\n")
        handle.flush()
    return handle


def holder() -> str | None:
    """The state dir of the cluster that uses the pod network now, if any."""
    handle = _acquire(LOCK)
    if handle is not None:
        handle.close()
        return None
    with contextlib.suppress(OSError):
        return LOCK.read_text().strip() or "another cluster"
    return "another cluster"


# -- commands


def _run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)


def _must(*argv: str, stdin: str | None = None) -> str:
    result = _run(*argv, stdin=stdin)
    if result.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def _routed(network: str) -> tuple[str, ...]:
    return ("route", "replace", network, "via", GATEWAY, "dev", "eth0")


# -- hosts


def add_host(ip: str, *, routes: Sequence[str]) -> Host:
    """A fresh namespace holding `ip`, joined to the host, routing only `routes` (networks)
    through the gateway; one left over from an earlier run is replaced."""
    host = Host(ip=ip)
    remove_host(ip)
    _must("ip", "netns", "add", host.netns)
    try:
        _must("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns",
              host.netns)  # fmt: skip
        _must("ip", "addr", "add", f"{GATEWAY}/32", "dev", host.link, "scope", "link")
        _must("ip", "link", "set", host.link, "up")
        _must("ip", "-n", host.netns, "link", "set", "lo", "up")
        _must("ip", "-n", host.netns, "addr", "add", f"{ip}/32", "dev", "eth0")
        _bring_up_inside(host, routes)
        _must("ip", "route", "replace", f"{ip}/32", "dev", host.link, "scope", "link", "src",
              GATEWAY)  # fmt: skip
    except OSError:
        remove_host(ip)
        raise
    return host


def _bring_up_inside(host: Host, routes: Sequence[str]) -> None:
    """The namespace's eth0 up, with its routes (a link going down takes them with it)."""
    inside = ("ip", "-n", host.netns)
    _must(*inside, "link", "set", "eth0", "up")
    # The host, as it answers for the gateway (connections from the host come from it).
    _must(*inside, "route", "replace", GATEWAY, "dev", "eth0", "scope", "link")
    for network in routes:
        _must(*inside, *_routed(network))


def cut(host: Host) -> None:
    """Cut the host off the network, as a failed link or a partition would: its eth0 goes down,
    and what is sent to it is dropped without an answer (its processes keep running)."""
    _must("ip", "-n", host.netns, "link", "set", "eth0", "down")


def restore(host: Host, *, routes: Sequence[str]) -> None:
    """Undo `cut`: the link up again, with the routes `add_host` gave it."""
    _bring_up_inside(host, routes)


def remove_host(ip: str) -> None:
    """Its veth (and with it the route) and its namespace; processes in it must be gone first,
    or the namespace lives on, unreachable, until they are."""
    host = Host(ip=ip)
    _run("ip", "link", "del", host.link)
    _run("ip", "netns", "del", host.netns)


def hosts() -> list[Host]:
    """Every namespace of the run's kind on this machine, by its name."""
    listed = _run("ip", "-json", "netns", "list").stdout.strip()
    names = [entry["name"] for entry in json.loads(listed or "[]")]
    found = []
    for name in names:
        if not name.startswith(NETNS_PREFIX):
            continue
        with contextlib.suppress(ValueError):
            ip = str(ipaddress.IPv4Address(name.removeprefix(NETNS_PREFIX).replace("-", ".")))
            found.append(Host(ip=ip))
    return found


def pids(host: Host) -> list[int]:
    """The processes running inside the host's namespace."""
    listed = _run("ip", "netns", "pids", host.netns).stdout.split()
    return [int(pid) for pid in listed if pid.isdigit()]


def host_links() -> list[str]:
    """The run's veths on the host side."""
    shown = json.loads(_run("ip", "-json", "link", "show").stdout or "[]")
    return [link["ifname"] for link in shown if link["ifname"].startswith(LINK_PREFIX)]


# -- the network as a whole


def claim(networks: Sequence[str], *, node_gateways: Sequence[str] = ()) -> None:
    """Unreachable routes for the networks (the pod network and the Service range: traffic to
    an address nothing serves, or to a Service kube-proxy has no rules for, fails at once
    instead of leaving by the default route), forwarding between the veths, and the filter that
    keeps the namespaces' traffic on this machine (and, with the real nodes' gateways, keeps
    what listens on them, the API server and the kubelets, to the run's own interfaces)."""
    for network in networks:
        _must("ip", "route", "replace", "unreachable", network)
    _must("nft", "-f", "-", stdin=filter_rules(node_gateways=node_gateways))
    forwarding = Path("/proc/sys/net/ipv4/ip_forward")
    if not FORWARDING_SAVED.exists():
        FORWARDING_SAVED.write_text(forwarding.read_text())
    forwarding.write_text("1\n")


def filter_rules(*, node_gateways: Sequence[str] = ()) -> str:
    ours = f'"{LINK_PREFIX}*"'
    # An address on any interface answers on every interface (Linux's weak host model): only
    # loopback and the run's links may reach the real nodes' gateways.
    addresses = ", ".join(str(ipaddress.IPv4Address(gateway)) for gateway in node_gateways)
    guard = (
        f"""
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    ip daddr {{ {addresses} }} iifname != "lo" iifname != {ours} drop
  }}"""
        if node_gateways
        else ""
    )
    return f"""\
table inet {FILTER_TABLE}
delete table inet {FILTER_TABLE}
table inet {FILTER_TABLE} {{
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname {ours} oifname != {ours} drop
    oifname {ours} iifname != {ours} drop
  }}{guard}
}}
"""


def release(networks: Sequence[str]) -> list[str]:
    """Every namespace and veth of the run, the tables, the routes and the sysctl; returns the
    IPs of the namespaces removed."""
    removed = hosts()
    for host in removed:
        remove_host(host.ip)
    for link in host_links():
        _run("ip", "link", "del", link)
    for family, table in (("inet", FILTER_TABLE), *KUBE_PROXY_TABLES):
        _run("nft", "delete", "table", family, table)
    for network in networks:
        _run("ip", "route", "del", "unreachable", network)
    with contextlib.suppress(FileNotFoundError):
        Path("/proc/sys/net/ipv4/ip_forward").write_text(FORWARDING_SAVED.read_text())
        FORWARDING_SAVED.unlink()
    return [host.ip for host in removed]


# -- client hosts


@contextlib.contextmanager
def client_host(*, routes: Sequence[str]) -> Iterator[Host]:
    """A namespace of its own for clients of Services, from CLIENT_NETWORK, removed at the end.

    Each address is held by an flock while in use, so two runs never share one and one left by
    a crashed run (its lock died with it) is taken back."""
    CLIENT_LOCKS.mkdir(exist_ok=True)
    for address in list(CLIENT_NETWORK.hosts())[1:]:
        lock = _acquire(CLIENT_LOCKS / f"{address}.lock")
        if lock is None:
            continue
        try:
            host = add_host(str(address), routes=routes)
            try:
                yield host
            finally:
                remove_host(host.ip)
        finally:
            lock.close()
        return
    raise OSError(f"every client address in {CLIENT_NETWORK} is in use")


# -- the lock, held by a component of the cluster


def hold_lock(owner: Path, ready_marker: Path) -> int:
    """Hold the pod network's lock for the cluster in `owner` until SIGTERM or SIGINT: the
    cluster's `podnetwork-lock` component, so that the lock lives and dies with the cluster."""
    lock = try_lock(owner)
    if lock is None:
        print(f"the pod network is in use by the cluster in {holder()}", flush=True)
        return 1
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    ready_marker.touch()
    stopped.wait()
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(hold_lock(Path(sys.argv[1]), Path(sys.argv[2])))
