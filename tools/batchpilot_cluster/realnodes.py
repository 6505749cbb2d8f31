"""A real node for the test cluster: containerd 2.x and a kubelet, Pods on a CNI bridge.

kwok nodes fake Pods; this one runs them. containerd (built from its Go module, with runc from
Debian) and a kubelet (built from the same Kubernetes module as the control plane) run as the
run's processes, each with its configuration, data and sockets under ``<state>/node``, so that
nothing of theirs lands in /var/lib, /run or /etc: containerd's root and state, the runc root,
network-namespace mounts (``netns_mounts_under_state_dir``), the kubelet's root, Pod logs and
volume-plugin dir, the CNI configuration and host-local's leases, a resolv.conf with no outside
resolver, and the pause image, built here (``pauseimages``) and pinned as the sandbox image.

Pods get their IPs from CNI (Debian's bridge, host-local and loopback plugins) on the bridge
``BRIDGE``, whose gateway, the first address of the node's podCIDR, the run creates before the
API server starts: the API server listens on it and advertises it, so the ``kubernetes`` Service
routes Pods to it through kube-proxy as in a cluster (in-cluster config just works), and the
kubelet serves on it, as a node serves on its InternalIP. Pods route only the pod network and
the Service range, through the gateway; there is no masquerade and no default route, and
podnetwork's filter keeps the bridge's traffic among the run's interfaces.

The node's cgroups sit under ``/<CGROUP_ROOT>`` in every hierarchy (the kubelet's
``cgroupRoot``, cgroupfs driver; runc mirrors them into the controller-less ``unified`` one), so
``clean`` can find them by name. ``clean`` needs nothing but the state dir and those names, so it
also cleans up after a run that was killed: it kills what runs in the node's cgroups, deletes
runc's containers, unmounts everything under the node's dir (deepest first), removes the cgroups,
the bridge and the veths on it, the shims' sockets, libcni's cache entries, the kubelet's
iptables chains and its links in /var/log/containers, and, from what ``prepare`` recorded before
the node ran, puts back the kernel tunables the kubelet changed and removes the iptables-nft
tables and fixed dirs that appeared only for it.
"""

import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from batchpilot_cluster import certificates

NAME = "batchpilot-node-0"
BRIDGE = "bpenode0"
"""On podnetwork's ``bpe`` prefix, so its filter treats the bridge as one of the run's links."""
CGROUP_ROOT = "batchpilot-e2e"
NETWORK_NAME = "batchpilot-e2e"
DIRECTORY_NAME = "node"
MAX_REAL_NODES = 4
"""Node 0 and up to three more (``nth``), each its own containerd, kubelet, bridge and cgroups."""
TAINT_KEY = "nvidia.com/gpu"
TAINT_VALUE = "present"
"""The real node is tainted as GKE and AKS taint their GPU nodes: Pods that do not tolerate it
stay on kwok. A Pod that asks for ``nvidia.com/gpu`` (once a test advertises some) gets the
toleration from the API server's ExtendedResourceToleration admission plugin, so an unmodified
Triton Deployment lands here as on a cluster's GPU node; other Pods meant for it tolerate the
taint and select NODE_LABEL."""
NODE_LABEL = ("batchpilot.dev/node", "real")
"""Node 0's label; node N's value is ``real-N``, so Pods that select node 0 stay there and a
test that spreads replicas over nodes names every value (``Node.label_value``)."""
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
CGROUP_MOUNTS = Path("/sys/fs/cgroup")
LEGACY_CONTAINER_LOGS = Path("/var/log/containers")
"""Where every kubelet links its containers' logs, whatever its podLogsDir."""
CNI_CACHE = Path("/var/lib/cni/results")
"""libcni's cache of results, named ``<network>-<container id>-<interface>``."""
KUBELET_CHAINS = (
    ("filter", "KUBE-FIREWALL"),
    ("mangle", "KUBE-IPTABLES-HINT"),
    ("mangle", "KUBE-KUBELET-CANARY"),
    ("nat", "KUBE-KUBELET-CANARY"),
    ("filter", "KUBE-KUBELET-CANARY"),
)
"""The kubelet's iptables chains (kubelet_network_linux.go), for kube-proxy's iptables mode."""
CRI_STATE = "io.containerd.grpc.v1.cri"
"""The CRI plugin's dir in containerd's state: sandboxes, and netns mounts."""
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
CPU_SHARES_PER_CORE = 1024
"""cgroup v1's weight of one process at nice 0 (cpu.shares)."""


class NodeError(Exception):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Node:
    """One real node; every path follows from the state dir."""

    name: str
    state_dir: Path
    pod_cidr: str
    bridge: str = BRIDGE
    cgroup_root: str = CGROUP_ROOT
    network_name: str = NETWORK_NAME
    directory_name: str = DIRECTORY_NAME
    label_value: str = NODE_LABEL[1]
    kubelet_port: int = 0
    kubelet_healthz_port: int = 0

    @property
    def directory(self) -> Path:
        return self.state_dir / self.directory_name

    @property
    def is_first(self) -> bool:
        """Node 0: the API server listens on its gateway, and it alone owns the host's settings
        that every kubelet shares (iptables chains, kernel tunables, fixed dirs)."""
        return self.directory_name == DIRECTORY_NAME

    def component(self, program: str) -> str:
        """The name its `program` (containerd, kubelet) runs under among the run's processes."""
        return program if self.is_first else f"{program}-{self.directory_name}"

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def containerd_socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.directory / "containerd.toml"

    @property
    def containerd_root(self) -> Path:
        return self.directory / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.directory / "run"

    @property
    def runc_root(self) -> Path:
        return self.directory / "runc"

    @property
    def kubelet_root(self) -> Path:
        return self.directory / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.directory / "kubelet.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.directory / "kubelet.kubeconfig"

    @property
    def pod_logs(self) -> Path:
        return self.directory / "pod-logs"

    @property
    def cni_conf_dir(self) -> Path:
        return self.directory / "cni"

    @property
    def ipam_dir(self) -> Path:
        return self.directory / "ipam"

    @property
    def resolv_conf(self) -> Path:
        return self.directory / "resolv.conf"

    @property
    def identity(self) -> certificates.Identity:
        """The kubelet's client identity, which Node authorization ties to this node."""
        return certificates.node_identity(self.name)


def nth(
    index: int,
    *,
    state_dir: Path,
    pod_cidr: str,
    kubelet_port: int = 0,
    kubelet_healthz_port: int = 0,
) -> Node:
    """Real node `index` of a run. Node 0 keeps the names a one-node run has always had; node N
    adds ``-N`` to its dir, cgroup root and network, and has bridge ``bpenodeN``."""
    if not 0 <= index < MAX_REAL_NODES:
        raise NodeError(f"real node {index}: a run has nodes 0 to {MAX_REAL_NODES - 1}")
    suffix = f"-{index}" if index else ""
    return Node(
        name=f"batchpilot-node-{index}",
        state_dir=state_dir,
        pod_cidr=pod_cidr,
        bridge=f"bpenode{index}",
        cgroup_root=CGROUP_ROOT + suffix,
        network_name=NETWORK_NAME + suffix,
        directory_name=DIRECTORY_NAME + suffix,
        label_value=NODE_LABEL[1] + suffix,
        kubelet_port=kubelet_port,
        kubelet_healthz_port=kubelet_healthz_port,
    )


# -- configuration, pure


def _toml_string(value: str) -> str:
    # JSON's string escapes are valid TOML basic-string escapes.
    return json.dumps(value)


def _toml_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(_toml_string(value) for value in values) + "]"


DISABLED_PLUGINS = (
    # Each would reach outside the node's dirs: /opt/containerd, /var/run/nri, a btrfs or
    # devmapper pool, an OTLP endpoint.
    "io.containerd.internal.v1.opt",
    "io.containerd.image-verifier.v1.bindir",
    "io.containerd.nri.v1.nri",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.blockfile",
    "io.containerd.snapshotter.v1.erofs",
    "io.containerd.tracing.processor.v1.otlp",
)


def containerd_config(node: Node, *, shim: Path, runc: Path, sandbox_image: str) -> str:
    """containerd's configuration (version 4, containerd 2.4's): the CRI plugin with runc from
    Debian under cgroupfs, CNI from the node's own conf dir, the local pause image, and every
    root, state and socket under the node's dir."""
    cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
    runc_runtime = f"{cri_runtime}.containerd.runtimes.runc"
    return f"""\
# Generated by tools/batchpilot_cluster/realnodes.py.
version = 4
root = {_toml_string(str(node.containerd_root))}
state = {_toml_string(str(node.containerd_state))}
imports = []
disabled_plugins = {_toml_list(DISABLED_PLUGINS)}

[plugins.'io.containerd.server.v1.grpc']
  address = {_toml_string(str(node.containerd_socket))}

[plugins.'io.containerd.server.v1.ttrpc']
  address = {_toml_string(str(node.containerd_socket) + ".ttrpc")}

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {_toml_string(sandbox_image)}

[{cri_runtime}]
  # No CAP_SYS_RESOURCE here: a negative oom_score_adj (the kubelet asks -998 for sandboxes)
  # fails runc's init, so scores are raised to containerd's own instead.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = []
  enable_unprivileged_ports = false
  enable_unprivileged_icmp = false

[{cri_runtime}.containerd]
  default_runtime_name = 'runc'

[{runc_runtime}]
  runtime_type = 'io.containerd.runc.v2'
  runtime_path = {_toml_string(str(shim))}

[{runc_runtime}.options]
  BinaryName = {_toml_string(str(runc))}
  Root = {_toml_string(str(node.runc_root))}
  SystemdCgroup = false

[{cri_runtime}.cni]
  bin_dirs = {_toml_list([str(CNI_BIN_DIR)])}
  conf_dir = {_toml_string(str(node.cni_conf_dir))}
  max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
"""


def cni_config(node: Node, *, routes: Sequence[str]) -> dict[str, Any]:
    """A bridge over the node's podCIDR with host-local addresses, routing only `routes`
    (the pod network and the Service range) through the gateway: no default route and no
    masquerade, so a Pod's traffic stays among the run's hosts."""
    return {
        "cniVersion": "1.0.0",
        "name": node.network_name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": node.bridge,
                "isGateway": True,
                "isDefaultGateway": False,
                "ipMasq": False,
                # A Pod reaching itself through a Service comes back over its own port.
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr, "gateway": node.gateway}]],
                    "routes": [{"dst": network} for network in routes],
                    "dataDir": str(node.ipam_dir),
                },
            }
        ],
    }


RESOLV_CONF = """\
# The e2e node's Pods have no DNS: nothing answers on a Pod's own loopback, so a lookup fails at
# once instead of reaching a resolver outside the run.
nameserver 127.0.0.1
options ndots:1 timeout:1 attempts:1
"""


def kubelet_config(node: Node, *, pki: certificates.Pki) -> dict[str, Any]:
    """The kubelet on cgroup v1 with the cgroupfs driver, authenticated by the run's CA and
    authorized by the API server, serving on the gateway with a certificate of the run's PKI.
    Imported images must stay (no registry to pull them again), so image GC is off; the
    eviction thresholds are ones a busy 2-core, 24 GiB machine does not trip."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # Kubernetes 1.35+ refuses cgroup v1 unless told (KEP-5573); these machines have v1.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{node.cgroup_root}",
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "failSwapOn": False,
        # True would refuse to start on this host's kernel.panic and vm.overcommit_memory; the
        # kubelet changes them instead, and ``clean`` puts them back.
        "protectKernelDefaults": False,
        "oomScoreAdj": 0,  # no CAP_SYS_RESOURCE to lower it (kube-proxy's is left alone too)
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "address": node.gateway,
        "port": node.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": node.kubelet_healthz_port,
        "tlsCertFile": str(pki.kubelet_serving_cert(node.name)),
        "tlsPrivateKeyFile": str(pki.kubelet_serving_key(node.name)),
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True, "cacheTTL": "10s"},
            "x509": {"clientCAFile": str(pki.ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "resolvConf": str(node.resolv_conf),
        "clusterDomain": "cluster.local",
        "podLogsDir": str(node.pod_logs),
        "volumePluginDir": str(node.directory / "volume-plugins"),
        "staticPodPath": "",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "24h",
        "evictionHard": {
            "memory.available": "256Mi",
            "nodefs.available": "2%",
            "nodefs.inodesFree": "2%",
            "imagefs.available": "2%",
        },
        "evictionPressureTransitionPeriod": "30s",
        # Pods start as soon as the kubelet sees them; status reaches the API at once.
        "syncFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "nodeStatusReportFrequency": "30s",
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",  # graceful node shutdown needs systemd's inhibitor locks
        # Every Triton of the e2e suite and the cluster benchmarks (bench_scale: 32 at once,
        # beside the Pods of namespaces still terminating).
        "maxPods": 110,
        "registerNode": True,
    }


def kubelet_argv(node: Node, *, kubelet: Path) -> list[str]:
    return [
        str(kubelet),
        f"--config={node.kubelet_config}",
        f"--kubeconfig={node.kubelet_kubeconfig}",
        f"--root-dir={node.kubelet_root}",
        f"--cert-dir={node.directory / 'kubelet-pki'}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.gateway}",
        "--v=1",
    ]


def containerd_argv(node: Node, *, containerd: Path) -> list[str]:
    return [str(containerd), f"--config={node.containerd_config}", "--log-level=info"]


def node_manifest(node: Node) -> dict[str, Any]:
    """The Node as the run registers it before the kubelet starts: with its podCIDR (nothing
    allocates one: the controller manager runs without --allocate-node-cidrs) and a GPU node's
    taint, which keeps Pods meant for kwok nodes off it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": {
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                NODE_LABEL[0]: node.label_value,
            },
        },
        "spec": {
            "podCIDR": node.pod_cidr,
            "podCIDRs": [node.pod_cidr],
            "taints": [{"key": TAINT_KEY, "value": TAINT_VALUE, "effect": "NoSchedule"}],
        },
    }


def check_paths(node: Node) -> None:
    """Unix sockets are limited to 108 bytes: say so instead of containerd failing oddly."""
    longest = str(node.containerd_socket) + ".ttrpc"
    if len(longest.encode()) > UNIX_PATH_MAX:
        raise NodeError(
            f"the state dir {node.state_dir} is too long for containerd's socket "
            f"({len(longest)} bytes, at most {UNIX_PATH_MAX}); use a shorter --state-dir"
        )


def missing_tools(*, runc: str | None, cni_bin_dir: Path = CNI_BIN_DIR) -> list[str]:
    """What the node needs from Debian and does not find, in words."""
    missing = []
    if runc is None:
        missing.append("runc (Debian package runc)")
    plugins = [plugin for plugin in CNI_PLUGINS if not (cni_bin_dir / plugin).is_file()]
    if plugins:
        missing.append(
            f"CNI plugins {', '.join(plugins)} in {cni_bin_dir} "
            "(Debian package containernetworking-plugins)"
        )
    for tool in ("ip", "iptables", "umount"):
        if shutil.which(tool) is None:
            missing.append(tool)
    return missing


# -- host setup


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def _must(*argv: str) -> str:
    result = _run(*argv)
    if result.returncode != 0:
        raise NodeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def cgroup_hierarchies(mounts: Path = CGROUP_MOUNTS) -> list[Path]:
    """Every mounted hierarchy: the v1 ones (cpu, memory, ..., name=systemd) and the
    controller-less v2 one at ``unified``, where runc mirrors each container's cgroup."""
    if not mounts.is_dir():
        return []
    return sorted(
        path
        for path in mounts.iterdir()
        if path.is_dir() and not path.is_symlink() and (path / "cgroup.procs").exists()
    )


def node_cpu_shares(cpus: int | None = None) -> int:
    """The node's cgroup's weight against the host's processes: as many busy processes as the
    host has cores (`CPU_SHARES_PER_CORE` each), as a machine of that many cores would get. The
    node's cgroup is one entity among the host's tasks, so at the default weight every Pod on
    it together weighed as much as one process, beside a vLLM engine and the local lane's
    Tritons (where Triton's Python-backend stubs were once seen to miss their 1-s health-mutex
    deadline: docs/tutorials/llm-fleet.md)."""
    return CPU_SHARES_PER_CORE * max(cpus or os.cpu_count() or 1, 1)


def make_cgroup_root(node: Node) -> None:
    """The kubelet refuses a cgroupRoot that does not exist in every hierarchy it uses."""
    for hierarchy in cgroup_hierarchies():
        if hierarchy.name == "unified":
            continue  # no controllers there; runc mirrors what it makes
        root = hierarchy / node.cgroup_root
        root.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            # A new cpuset has no CPUs or memory nodes until given its parent's.
            for name in ("cpuset.cpus", "cpuset.mems"):
                (root / name).write_text((hierarchy / name).read_text())
        if (root / "cpu.shares").exists():
            (root / "cpu.shares").write_text(f"{node_cpu_shares()}\n")


def make_bridge(node: Node) -> None:
    """The node's bridge with the gateway address, up before the API server binds to it; the
    bridge plugin finds and reuses it."""
    _run("ip", "link", "del", node.bridge)
    _must("ip", "link", "add", node.bridge, "type", "bridge")
    _must("ip", "addr", "add", f"{node.gateway}/{ipaddress.ip_network(node.pod_cidr).prefixlen}",
          "dev", node.bridge)  # fmt: skip
    _must("ip", "link", "set", node.bridge, "up")


def prepare(node: Node, *, routes: Sequence[str]) -> None:
    """Everything the node needs on disk before containerd and the kubelet start."""
    check_paths(node)
    missing = missing_tools(runc=shutil.which("runc"))
    if missing:
        raise NodeError(f"the real node needs {'; '.join(missing)}: run `make deps`")
    for path in (node.directory, node.cni_conf_dir, node.ipam_dir, node.pod_logs):
        path.mkdir(parents=True, exist_ok=True)
    node.resolv_conf.write_text(RESOLV_CONF)
    (node.cni_conf_dir / "10-batchpilot-e2e.conflist").write_text(
        json.dumps(cni_config(node, routes=routes), indent=2) + "\n"
    )
    make_cgroup_root(node)
    record_host_state(node)  # before containerd: its shims make /run/containerd/s


# -- images


def has_image(node: Node, *, ctr: Path, reference: str) -> bool:
    """Whether the CRI's namespace holds the image `reference`."""
    argv = [str(ctr), "--address", str(node.containerd_socket), "--namespace", "k8s.io",
            "images", "list", "--quiet", f"name=={reference}"]  # fmt: skip
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if completed.returncode != 0:
        raise NodeError(f"listing images: {completed.stderr.strip()[-1000:]}")
    return reference in completed.stdout.split()


def import_image(node: Node, *, ctr: Path, archive: Path, timeout: float = 300.0) -> None:
    """Import an OCI archive into the CRI's namespace, unpacked for its snapshotter."""
    argv = [str(ctr), "--address", str(node.containerd_socket), "--namespace", "k8s.io",
            "images", "import", "--snapshotter", "overlayfs", str(archive)]  # fmt: skip
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NodeError(f"importing {archive} took more than {timeout:.0f} s") from None
    if completed.returncode != 0:
        raise NodeError(f"importing {archive}: {completed.stderr.strip()[-1000:]}")


# -- cleanup, from names alone


def _mount_points() -> list[str]:
    """Mount points in /proc/self/mountinfo order (parents before children)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        # mountinfo escapes space, tab, newline and backslash as octal.
        points.append(fields[4].encode().decode("unicode_escape"))
    return points


def mounts_under(directory: Path) -> list[str]:
    prefix = str(directory).rstrip("/") + "/"
    return [point for point in _mount_points() if point.startswith(prefix)]


def cgroups_under(name: str) -> list[Path]:
    """Every cgroup of the node in every hierarchy, deepest first."""
    found = []
    for hierarchy in cgroup_hierarchies():
        root = hierarchy / name
        if root.is_dir():
            found += [Path(dirpath) for dirpath, _, _ in os.walk(root)]
    return sorted(found, key=lambda path: len(path.parts), reverse=True)


def _cgroup_pids(cgroups: Sequence[Path]) -> set[int]:
    pids: set[int] = set()
    for cgroup in cgroups:
        with contextlib.suppress(OSError):
            pids.update(int(pid) for pid in (cgroup / "cgroup.procs").read_text().split())
    return pids


def kill_cgroups(name: str, *, timeout: float = 10.0) -> list[int]:
    """SIGKILL whatever runs in the node's cgroups (containers, pause processes) until nothing
    does; the pids killed. A frozen cgroup is thawed first, or its tasks could not die."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        cgroups = cgroups_under(name)
        for cgroup in cgroups:
            state = cgroup / "freezer.state"
            with contextlib.suppress(OSError):
                if state.read_text().strip() != "THAWED":
                    state.write_text("THAWED")
        pids = _cgroup_pids(cgroups)
        if not pids:
            return sorted(killed)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        if time.monotonic() > deadline:
            raise NodeError(f"processes {sorted(pids)} in the node's cgroups outlived SIGKILL")
        time.sleep(0.1)


def delete_runc_containers(runc_root: Path) -> list[str]:
    """runc's record of each container, deleted by force; the shim gives runc a root per
    containerd namespace (``<root>/k8s.io``)."""
    runc = shutil.which("runc")
    if runc is None or not runc_root.is_dir():
        return []
    ids = []
    for root in sorted(path for path in runc_root.iterdir() if path.is_dir()):
        listed = _run(runc, "--root", str(root), "list", "--format", "json").stdout.strip()
        try:
            containers = json.loads(listed or "[]") or []
        except json.JSONDecodeError:
            containers = []
        for container in containers:
            _run(runc, "--root", str(root), "delete", "--force", str(container["id"]))
            ids.append(str(container["id"]))
    return ids


def unmount_under(directory: Path) -> list[str]:
    """Unmount everything under the directory, children before parents; what was unmounted."""
    done = []
    for _ in range(3):  # a lazy unmount of a parent may uncover mounts stacked below it
        points = mounts_under(directory)
        if not points:
            break
        for point in reversed(points):
            if _run("umount", point).returncode != 0:
                _run("umount", "--lazy", point)
            done.append(point)
    left = mounts_under(directory)
    if left:
        raise NodeError(f"still mounted under {directory}: {left}")
    return done


def remove_cgroups(name: str) -> list[Path]:
    removed = []
    for cgroup in cgroups_under(name):
        with contextlib.suppress(FileNotFoundError):
            cgroup.rmdir()
            removed.append(cgroup)
    left = cgroups_under(name)
    if left:
        raise NodeError(f"cgroups left: {[str(path) for path in left]}")
    return removed


def bridge_ports(bridge: str) -> list[str]:
    shown = _run("ip", "-json", "link", "show", "master", bridge)
    if shown.returncode != 0:
        return []
    return [str(link["ifname"]) for link in json.loads(shown.stdout or "[]")]


def remove_links(bridge: str) -> list[str]:
    """The veths on the bridge (their Pods' ends die with them), then the bridge."""
    removed = bridge_ports(bridge)
    for link in removed:
        _run("ip", "link", "del", link)
    if _run("ip", "link", "del", bridge).returncode == 0:
        removed.append(bridge)
    return removed


SHIM_SOCKETS = Path("/run/containerd/s")
"""Where every containerd puts its shims' sockets, named by a hash, whatever its state dir."""


def shim_address(bundle: Path) -> str | None:
    """The shim's address as its task bundle records it (bootstrap.json, or the older
    ``address`` file)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return str(json.loads((bundle / "bootstrap.json").read_text())["address"])
    with contextlib.suppress(OSError):
        return (bundle / "address").read_text().strip()
    return None


def shim_sockets(containerd_state: Path, *, socket_dir: Path = SHIM_SOCKETS) -> list[Path]:
    """The sockets of the node's shims: only paths in socket_dir are trusted from a bundle."""
    sockets = []
    for bundle in containerd_state.glob("io.containerd.runtime.v2.task/*/*"):
        address = shim_address(bundle) or ""
        path = Path(address.removeprefix("unix://"))
        if address.startswith("unix://") and path.parent == socket_dir:
            sockets.append(path)
    return sockets


def sandbox_ids(containerd_state: Path) -> list[str]:
    return [path.name for path in containerd_state.glob(f"{CRI_STATE}/sandboxes/*")]


IPTABLES_TABLES = tuple(
    (family, table) for family in ("ip", "ip6") for table in ("filter", "mangle", "nat")
)
"""The nftables tables iptables-nft makes on first use, the kubelet's chains among them."""
TABLES_RECORD = "nft-tables-before.json"
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
"""What a kubelet sets on the host at start (setupKernelTunables), unless protectKernelDefaults,
which makes it refuse to start where they differ; they are restored by ``clean``."""
SYSCTLS_RECORD = "sysctls-before.json"
HOST_DIRS = (
    LEGACY_CONTAINER_LOGS,
    CNI_CACHE,
    CNI_CACHE.parent,
    Path("/run/containerd/s"),
    Path("/run/containerd"),
)
"""Fixed paths the kubelet, libcni and the shims make when missing; deepest first."""
DIRS_RECORD = "dirs-before.json"
PROC_SYS = Path("/proc/sys")


def nft_tables() -> list[tuple[str, str]]:
    listed = _run("nft", "-j", "list", "tables")
    if listed.returncode != 0:
        return []
    entries = json.loads(listed.stdout or "{}").get("nftables", [])
    return [
        (str(entry["table"]["family"]), str(entry["table"]["name"]))
        for entry in entries
        if "table" in entry
    ]


def record_host_state(node: Node, *, proc_sys: Path = PROC_SYS) -> None:
    """What the kubelet changes on the host, as it was before: the iptables-nft tables that
    existed (``clean`` leaves those) and the kernel tunables (``clean`` restores them). An
    earlier record is kept: after a crash, the host no longer shows the original values."""
    tables = node.directory / TABLES_RECORD
    if not tables.exists():
        tables.write_text(json.dumps(nft_tables()))
    dirs = node.directory / DIRS_RECORD
    if not dirs.exists():
        dirs.write_text(json.dumps([str(path) for path in HOST_DIRS if path.exists()]))
    sysctls = node.directory / SYSCTLS_RECORD
    if not sysctls.exists():
        values = {name: (proc_sys / name).read_text().strip() for name in KERNEL_TUNABLES}
        sysctls.write_text(json.dumps(values))


def remove_dirs_made_for_the_node(node_dir: Path) -> list[Path]:
    """The fixed dirs that did not exist before the node ran, if nothing else is in them."""
    try:
        before = set(json.loads((node_dir / DIRS_RECORD).read_text()))
    except (OSError, ValueError):
        return []
    removed = []
    for path in HOST_DIRS:
        if str(path) not in before and path.is_dir():
            with contextlib.suppress(OSError):  # not empty: someone else's now
                path.rmdir()
                removed.append(path)
    return removed


def restore_sysctls(node_dir: Path, *, proc_sys: Path = PROC_SYS) -> dict[str, str]:
    """The kernel tunables the kubelet changed, back as recorded; those that were changed."""
    try:
        recorded = json.loads((node_dir / SYSCTLS_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    restored = {}
    for name in KERNEL_TUNABLES:
        value = str(recorded.get(name, ""))
        path = proc_sys / name
        if value and path.read_text().strip() != value:
            path.write_text(value + "\n")
            restored[name] = value
    return restored


def _rule_count(family: str, table: str) -> int:
    listed = _run("nft", "-j", "list", "table", family, table)
    if listed.returncode != 0:
        return -1
    return sum("rule" in entry for entry in json.loads(listed.stdout).get("nftables", []))


def remove_tables_made_for_the_kubelet(node_dir: Path) -> list[tuple[str, str]]:
    """The iptables-nft tables that appeared while the node ran and hold no rule now; none
    when the record is gone (then nobody knows whose they are)."""
    try:
        before = {
            (family, table) for family, table in json.loads((node_dir / TABLES_RECORD).read_text())
        }
    except (OSError, ValueError):
        return []
    removed = []
    for family, table in IPTABLES_TABLES:
        if (family, table) in before or _rule_count(family, table) != 0:
            continue
        if _run("nft", "delete", "table", family, table).returncode == 0:
            removed.append((family, table))
    return removed


def remove_kubelet_chains() -> None:
    """The kubelet's iptables chains and the jumps to KUBE-FIREWALL (both families)."""
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for chain in ("INPUT", "OUTPUT"):
            # -D removes one rule per call; the kubelet adds each jump once, but a restart may not.
            while _run(tool, "-t", "filter", "-D", chain, "-j", "KUBE-FIREWALL").returncode == 0:
                pass
        for table, chain in KUBELET_CHAINS:
            if _run(tool, "-t", table, "-F", chain).returncode == 0:
                _run(tool, "-t", table, "-X", chain)


def remove_log_links(pod_logs: Path, *, links_dir: Path = LEGACY_CONTAINER_LOGS) -> list[Path]:
    removed: list[Path] = []
    if not links_dir.is_dir():
        return removed
    prefix = str(pod_logs).rstrip("/") + "/"
    for link in links_dir.iterdir():
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(prefix):
                link.unlink()
                removed.append(link)
    return removed


def remove_cni_cache(
    network_name: str, sandboxes: Sequence[str], *, cache: Path = CNI_CACHE
) -> list[Path]:
    """libcni's cached results of the node's network and of the loopback it set up per
    sandbox (``cni-loopback-<sandbox>-lo``)."""
    removed: list[Path] = []
    if not cache.is_dir():
        return removed
    entries = list(cache.glob(f"{network_name}-*"))
    entries += [cache / f"cni-loopback-{sandbox}-lo" for sandbox in sandboxes]
    for entry in entries:
        if entry.is_file():
            entry.unlink()
            removed.append(entry)
    return removed


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cleaned:
    killed: tuple[int, ...]
    containers: tuple[str, ...]
    unmounted: tuple[str, ...]
    cgroups: tuple[Path, ...]
    links: tuple[str, ...]

    def summary(self) -> str:
        parts = [
            f"{len(self.killed)} processes killed" if self.killed else "",
            f"{len(self.containers)} runc containers deleted" if self.containers else "",
            f"{len(self.unmounted)} mounts" if self.unmounted else "",
            f"{len(self.cgroups)} cgroups" if self.cgroups else "",
            f"links {', '.join(self.links)}" if self.links else "",
        ]
        return "; ".join(part for part in parts if part)


def clean(
    node_dir: Path,
    *,
    bridge: str = BRIDGE,
    cgroup_root: str = CGROUP_ROOT,
    network_name: str = NETWORK_NAME,
    keep_bridge: bool = False,
    machine_wide: bool = True,
    host_settings: bool = True,
) -> Cleaned:
    """Remove what a node left, from its dir and names alone: run after its kubelet, containerd
    and shims were stopped (``processes.sweep`` finds those by their owner mark). The bridge
    may stay (the API server listens on its gateway) while the node alone is restarted.
    Without `machine_wide` (another cluster runs), only what is under node_dir goes: the
    bridge, the cgroups and the host's settings are found by name, and would be its. Without
    `host_settings` (a node after the first, whose kubelet shares them with node 0's), the
    kubelet's iptables chains, the kernel tunables and the fixed dirs are left to node 0's."""
    killed = kill_cgroups(cgroup_root) if machine_wide else []
    containers = delete_runc_containers(node_dir / "runc")
    sockets = shim_sockets(node_dir / "run")
    sandboxes = sandbox_ids(node_dir / "run")
    unmounted = unmount_under(node_dir)
    cgroups: list[Path] = []
    links: list[str] = []
    if machine_wide:
        cgroups = remove_cgroups(cgroup_root)
        links = [] if keep_bridge else remove_links(bridge)
        for veth in bridge_ports(bridge) if keep_bridge else []:
            _run("ip", "link", "del", veth)  # gone with their namespaces already, normally
            links.append(veth)
    for socket in sockets:
        socket.unlink(missing_ok=True)
    host_wide = machine_wide and host_settings
    if host_wide:
        remove_kubelet_chains()
        remove_tables_made_for_the_kubelet(node_dir)
        restore_sysctls(node_dir)
    remove_log_links(node_dir / "pod-logs")
    remove_cni_cache(network_name, sandboxes)
    if host_wide:  # last: the links and cache entries above were in them
        remove_dirs_made_for_the_node(node_dir)
    if node_dir.exists():
        shutil.rmtree(node_dir)
    return Cleaned(
        killed=tuple(killed),
        containers=tuple(containers),
        unmounted=tuple(unmounted),
        cgroups=tuple(cgroups),
        links=tuple(links),
    )


def clean_node(node: Node, *, keep_bridge: bool = False, machine_wide: bool = True) -> Cleaned:
    """`clean` with the node's own names; the host's shared settings go with node 0 only."""
    return clean(
        node.directory,
        bridge=node.bridge,
        cgroup_root=node.cgroup_root,
        network_name=node.network_name,
        keep_bridge=keep_bridge,
        machine_wide=machine_wide,
        host_settings=node.is_first,
    )


def leftovers(node: Node) -> dict[str, list[str]]:
    """What a node leaves behind if `clean` missed something; empty when clean."""
    found = {
        "mounts": mounts_under(node.directory),
        "cgroups": [str(path) for path in cgroups_under(node.cgroup_root)],
        "links": [node.bridge] * (_run("ip", "link", "show", node.bridge).returncode == 0),
        "netns": [str(path) for path in node.containerd_state.glob(f"{CRI_STATE}/netns/*")],
    }
    return {kind: items for kind, items in found.items() if items}


def environment(bin_dir: Path, base: Mapping[str, str]) -> dict[str, str]:
    """containerd looks up shims on PATH before its own dir: ours first, not Debian's 1.6."""
    return {**base, "PATH": f"{bin_dir}:{base.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
