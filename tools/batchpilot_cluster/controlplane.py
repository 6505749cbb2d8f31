"""Bring the test control plane up and down as plain processes on loopback.

``start`` follows envtest's recipe for a standalone API server and adds what envtest leaves out
because the operator's e2e tests need it: the controller manager (Deployments make ReplicaSets
make Pods; namespaces get deleted; service-account tokens and root-CA config maps appear;
EndpointSlices follow Pods' readiness), the scheduler, kwok for nodes and pod status, kube-proxy
(nftables mode) so that Services route to Ready Pods as in a cluster, client network namespaces
(``podnetwork``), and one real node (``realnodes``: containerd and a kubelet, Pods on a CNI
bridge) for the Pods that must really run, or more of them (``real_nodes``: each its own
containerd, kubelet, bridge, podCIDR and cgroups, the host routing between their bridges).

The API server listens on the real node's bridge gateway, not on 127.0.0.1: Pods reach it
through the ``kubernetes`` Service (in-cluster config), whose endpoint the API server maintains
from its advertise address, and Endpoints refuse loopback addresses. The bridge exists before
the API server starts, the serving certificate names the address, and podnetwork's filter drops
what would reach it from outside the run's interfaces.
Everything one run owns sits in its state dir, and ``stop`` needs nothing but that dir, so it also
cleans up after a run that was killed.
"""

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from batchpilot_cluster import (
    audit,
    building,
    certificates,
    clientconfigs,
    locations,
    pauseimages,
    podnetwork,
    processes,
    realnodes,
    rest,
    versions,
)
from batchpilot_harness import local_triton, procfs

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
POD_NETWORK = ipaddress.ip_network("10.88.0.0/16")  # one /24 per node, like --allocate-node-cidrs
HOST_ROUTES = (str(POD_NETWORK), SERVICE_CLUSTER_IP_RANGE)
"""What every network namespace of the run, a Pod's or a client's, routes through the host."""
MAX_NODES = 255 - realnodes.MAX_REAL_NODES
"""kwok nodes take 10.88.0-250; real node N 10.88.(254-N); clients 10.88.255."""
NODE_PREFIX = "kwok-node-"
E2E_REAL_NODES = 2
"""The e2e suite's cluster (``up``'s default): node 0 runs every test's Pods, and both run the
tests that spread replicas over nodes (``fleet.spread_placement``)."""
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
STAGES_FILE = Path(__file__).with_name("kwok") / "stages.yaml"
# Stop order: the kubelet first (it would restart what containerd loses), then containerd,
# etcd, and the pod network's lock last.
COMPONENTS = (
    "podnetwork-lock",
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kube-proxy",
    "containerd",
    "kubelet",
)
STATE_FILE = "state.json"


class ClusterError(Exception):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    kube_proxy_healthz: int
    kube_proxy_metrics: int
    kubelet: int
    kubelet_healthz: int


def real_node_pod_cidr(index: int) -> str:
    """Real node N's podCIDR: from the top of the pod network down, below the clients'."""
    return str(list(POD_NETWORK.subnets(new_prefix=24))[254 - index])


REAL_NODE_POD_CIDR = real_node_pod_cidr(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """What a running cluster's users need; saved as state.json in its state dir."""

    state_dir: Path
    kubernetes_version: str
    ports: Ports
    nodes: tuple[str, ...]
    pod_cidrs: tuple[str, ...]
    extra_node_ports: tuple[tuple[int, int], ...] = ()
    """The kubelet port and healthz port of each real node after the first."""

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def real_nodes(self) -> tuple[realnodes.Node, ...]:
        """Node 0, where the API server listens, then the others."""
        ports = ((self.ports.kubelet, self.ports.kubelet_healthz), *self.extra_node_ports)
        return tuple(
            realnodes.nth(
                index,
                state_dir=self.state_dir,
                pod_cidr=real_node_pod_cidr(index),
                kubelet_port=kubelet,
                kubelet_healthz_port=healthz,
            )
            for index, (kubelet, healthz) in enumerate(ports)
        )

    @property
    def node(self) -> realnodes.Node:
        return self.real_nodes[0]

    @property
    def api_address(self) -> str:
        return str(self.node.gateway)

    @property
    def server(self) -> str:
        return f"https://{self.api_address}:{self.ports.apiserver}"

    @property
    def pki(self) -> certificates.Pki:
        return certificates.Pki(directory=self.state_dir / "pki")

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    def log(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"

    def client(self, identity: certificates.Identity = certificates.ADMIN) -> rest.Client:
        return rest.Client(
            server=self.server,
            ca_file=str(self.pki.ca_cert),
            cert_file=str(self.pki.client_cert(identity)),
            key_file=str(self.pki.client_key(identity)),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "kubernetes_version": self.kubernetes_version,
                "ports": dataclasses.asdict(self.ports),
                "nodes": list(self.nodes),
                "pod_cidrs": list(self.pod_cidrs),
                "extra_node_ports": [list(ports) for ports in self.extra_node_ports],
                "real_nodes": [node.name for node in self.real_nodes],
                "kubeconfig": str(self.kubeconfig),
                "server": self.server,
            },
            indent=2,
        )

    @classmethod
    def load(cls, state_dir: Path) -> "Cluster":
        data = json.loads((state_dir / STATE_FILE).read_text())
        return cls(
            state_dir=state_dir,
            kubernetes_version=data["kubernetes_version"],
            ports=Ports(**data["ports"]),
            nodes=tuple(data["nodes"]),
            pod_cidrs=tuple(data["pod_cidrs"]),
            extra_node_ports=tuple(
                (int(kubelet), int(healthz))
                for kubelet, healthz in data.get("extra_node_ports", [])
            ),
        )


def pick_ports(*, extra_nodes: int = 0) -> tuple[Ports, tuple[tuple[int, int], ...]]:
    """Ports that were free a moment ago (the window before the components bind them is small):
    the cluster's, and a kubelet port and a healthz port for each real node after the first."""
    names = [field.name for field in dataclasses.fields(Ports)]
    chosen = local_triton.free_ports("127.0.0.1", len(names) + 2 * extra_nodes)
    extra = chosen[len(names) :]
    return (
        Ports(**dict(zip(names, chosen[: len(names)], strict=True))),
        tuple((extra[2 * i], extra[2 * i + 1]) for i in range(extra_nodes)),
    )


def node_pod_cidr(index: int) -> str:
    return str(list(POD_NETWORK.subnets(new_prefix=24))[index])


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


_ERROR_LINE = re.compile(r"^[EF]\d{4} |level=(error|fatal)")
"""klog's error and fatal lines (the kubelet, the control plane), logrus's (containerd)."""


def last_error(path: Path) -> str | None:
    """The last error line of a component's log: why it stopped, usually, after pages of
    flags."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return errors[-1].strip()[:500] if errors else None


class _Startup:
    """Starts components one by one and fails fast, with its log, when one of them dies."""

    def __init__(self, cluster: Cluster, *, say: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.say = say
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        self.t0 = time.monotonic()

    def start(self, name: str, argv: Sequence[str], **kwargs: Any) -> None:
        self.started[name] = processes.start(
            name=name,
            argv=argv,
            state_dir=self.cluster.state_dir,
            log_path=self.cluster.log(name),
            **kwargs,
        )

    def wait(
        self,
        what: str,
        ready: Callable[[], bool],
        *,
        timeout: float = 60.0,
        log_of: str | None = None,
    ) -> None:
        """Poll `ready` until it holds; a component that exits, or the deadline, raises (with the
        log of `log_of`, the component waited for, on a timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            for name, process in self.started.items():
                if process.poll() is not None:
                    log = self.cluster.log(name)
                    raise ClusterError(
                        f"{name} exited with {process.returncode} while waiting for {what}"
                        f"{': ' + reason if (reason := last_error(log)) else ''}; "
                        f"last lines of {log}:\n{tail(log)}"
                    )
            try:
                if ready():
                    break
            except (OSError, rest.ApiError, ValueError):
                pass
            if time.monotonic() > deadline:
                message = f"timed out after {timeout:.0f} s waiting for {what}"
                if log_of is not None:
                    log = self.cluster.log(log_of)
                    message += f"; last lines of {log}:\n{tail(log)}"
                raise ClusterError(message)
            time.sleep(0.2)
        self.say(f"  {what}: {time.monotonic() - self.t0:.1f} s")


def _http_ok(url: str, *, expect: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return expect in response.read().decode()


def _https_ok_insecure(url: str) -> bool:
    """Health of components that serve a self-signed certificate they made themselves."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, context=context, timeout=2) as response:
        return bool(response.read().decode().strip() == "ok")


def _node_ready(client: rest.Client, name: str) -> bool:
    node = client.get(f"/api/v1/nodes/{name}")
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def node_manifest(name: str, pod_cidr: str) -> rest.JsonObject:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
    }


def kube_proxy_config(cluster: Cluster, *, kubeconfig: Path) -> dict[str, Any]:
    """kube-proxy in nftables mode (its rules in tables of its own, which ``podnetwork.release``
    removes), serving on loopback, leaving the host's conntrack sysctls and its own OOM score
    alone. Clients and Pods are all in the pod network, so nothing is masqueraded."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": cluster.node.name,
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": f"127.0.0.1:{cluster.ports.kube_proxy_healthz}",
        "metricsBindAddress": f"127.0.0.1:{cluster.ports.kube_proxy_metrics}",
        "clusterCIDR": str(POD_NETWORK),
        "detectLocalMode": "ClusterCIDR",
        # Endpoint changes reach the rules at once: a drain waits for them (settle time).
        "nftables": {"minSyncPeriod": "0s", "syncPeriod": "30s"},
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "oomScoreAdj": 0,
    }


def is_up(state_dir: Path) -> bool:
    try:
        cluster = Cluster.load(state_dir)
        return cluster.client().text("/readyz").strip() == "ok"
    except (FileNotFoundError, OSError, rest.ApiError, ValueError, KeyError, TypeError):
        return False  # TypeError: a state dir written by an older version


def start(
    *,
    state_dir: Path | None = None,
    nodes: int = 1,
    real_nodes: int = 1,
    say: Callable[[str], None] = print,
) -> Cluster:
    """Start a fresh cluster in state_dir (stopping any leftovers there first), with `nodes`
    kwok nodes and `real_nodes` real ones."""
    if not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"nodes must be between 1 and {MAX_NODES}")
    if not 1 <= real_nodes <= realnodes.MAX_REAL_NODES:
        raise ClusterError(f"real nodes must be between 1 and {realnodes.MAX_REAL_NODES}")
    state_dir = (state_dir or locations.state_dir()).resolve()
    bin_dir = building.require_binaries()
    stop(state_dir=state_dir, keep_logs=False, say=lambda _: None)
    in_use_by = podnetwork.holder()
    if in_use_by is not None:
        raise ClusterError(f"the pod network {POD_NETWORK} is in use by the cluster in {in_use_by}")
    # Two clusters starting at once both find the lock free: their bridge, cgroups and network
    # are the machine's, so never take them from under another cluster's processes.
    others = processes.other_owners(state_dir)
    if others:
        raise ClusterError(
            f"another cluster runs on this machine, from {', '.join(sorted(others))}"
        )
    # A run killed elsewhere (another checkout, its lock gone with it) may have left network
    # namespaces on IPs kwok is about to hand out again; stopping this state_dir misses those.
    removed = podnetwork.release(HOST_ROUTES)
    if removed:
        say(f"removed network namespaces an earlier run left: {', '.join(removed)}")
    state_dir.mkdir(parents=True)
    ports, extra_node_ports = pick_ports(extra_nodes=real_nodes - 1)
    cluster = Cluster(
        state_dir=state_dir,
        kubernetes_version=versions.KUBERNETES,
        ports=ports,
        nodes=tuple(f"{NODE_PREFIX}{i}" for i in range(nodes)),
        pod_cidrs=tuple(node_pod_cidr(i) for i in range(nodes)),
        extra_node_ports=extra_node_ports,
    )
    (state_dir / STATE_FILE).write_text(cluster.to_json())
    say(f"starting Kubernetes {versions.KUBERNETES} in {state_dir}")
    startup = _Startup(cluster, say=say)
    try:
        lock_taken = state_dir / "podnetwork-lock.ready"
        startup.start(
            "podnetwork-lock",
            [
                sys.executable,
                "-m",
                "batchpilot_cluster.podnetwork",
                str(state_dir),
                str(lock_taken),
            ],
            cwd=locations.REPO_ROOT,
        )
        startup.wait("the pod network's lock", lock_taken.exists, log_of="podnetwork-lock")
        for node in cluster.real_nodes:
            realnodes.prepare(node, routes=HOST_ROUTES)
        pause_archive = pauseimages.build()
        _start_components(cluster, startup, bin_dir=bin_dir, pause_archive=pause_archive)
    except (realnodes.NodeError, pauseimages.PauseImageError) as error:
        stop(state_dir=state_dir, keep_logs=True, say=lambda _: None)
        raise ClusterError(str(error)) from None
    except BaseException:
        stop(state_dir=state_dir, keep_logs=True, say=lambda _: None)
        raise
    say(f"start: {time.monotonic() - startup.t0:.1f} s; KUBECONFIG={cluster.kubeconfig}")
    return cluster


def _start_components(
    cluster: Cluster, startup: _Startup, *, bin_dir: Path, pause_archive: Path
) -> None:
    ports = cluster.ports
    state_dir = cluster.state_dir
    pki = certificates.generate(
        cluster.pki.directory,
        dns_names=(
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        ip_addresses=(
            "127.0.0.1",
            cluster.api_address,
            str(next(ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE).hosts())),
        ),
    )
    for node in cluster.real_nodes:
        certificates.issue_node(pki, node_name=node.name, node_ip=node.gateway)
    clientconfigs.write(
        cluster.kubeconfig, server=cluster.server, pki=pki, identity=certificates.ADMIN
    )
    component_kubeconfig = {
        identity: clientconfigs.write(
            state_dir / f"{identity.file_stem}.kubeconfig",
            server=cluster.server,
            pki=pki,
            identity=identity,
        )
        for identity in (certificates.CONTROLLER_MANAGER, certificates.SCHEDULER)
    }

    etcd_client = f"http://127.0.0.1:{ports.etcd_client}"
    etcd_peer = f"http://127.0.0.1:{ports.etcd_peer}"
    startup.start(
        "etcd",
        [
            str(bin_dir / "etcd"),
            "--name=batchpilot-e2e",
            f"--data-dir={state_dir / 'etcd'}",
            f"--listen-client-urls={etcd_client}",
            f"--advertise-client-urls={etcd_client}",
            f"--listen-peer-urls={etcd_peer}",
            f"--initial-advertise-peer-urls={etcd_peer}",
            f"--initial-cluster=batchpilot-e2e={etcd_peer}",
            "--unsafe-no-fsync",  # throwaway data; fsync is most of etcd's latency on a VM disk
            "--log-level=warn",
        ],
    )
    startup.wait("etcd healthy", lambda: _http_ok(f"{etcd_client}/health", expect='"true"'))

    # The API server binds the real node's gateway: the bridges first, and the filter that keeps
    # them to the run's interfaces.
    for node in cluster.real_nodes:
        realnodes.make_bridge(node)
    podnetwork.claim(HOST_ROUTES, node_gateways=[node.gateway for node in cluster.real_nodes])
    startup.start(
        "kube-apiserver",
        [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_client}",
            f"--bind-address={cluster.api_address}",
            f"--advertise-address={cluster.api_address}",
            f"--secure-port={ports.apiserver}",
            f"--cert-dir={pki.directory}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            # Webhooks (and aggregated APIs) are called at one of their Service's endpoints,
            # not at its ClusterIP: this host routes the Service range as unreachable
            # (podnetwork), so its own connections never reach kube-proxy's rules, as they
            # would on a control-plane node whose default route covers the range.
            "--enable-aggregator-routing=true",
            f"--kubelet-certificate-authority={pki.ca_cert}",
            f"--kubelet-client-certificate={pki.client_cert(certificates.APISERVER_KUBELET_CLIENT)}",
            f"--kubelet-client-key={pki.client_key(certificates.APISERVER_KUBELET_CLIENT)}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            # Pods that ask for nvidia.com/gpu tolerate the real node's GPU taint, as on GKE.
            "--enable-admission-plugins=ExtendedResourceToleration",
            "--profiling=false",
            *audit.apiserver_flags(state_dir),
        ],
    )
    admin = cluster.client()
    startup.wait("kube-apiserver ready", lambda: admin.text("/readyz").strip() == "ok")

    for name, identity, port in (
        ("kube-controller-manager", certificates.CONTROLLER_MANAGER, ports.controller_manager),
        ("kube-scheduler", certificates.SCHEDULER, ports.scheduler),
    ):
        kubeconfig = component_kubeconfig[identity]
        argv = [
            str(bin_dir / name),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={state_dir / name}",  # self-signed serving cert; default is /var/run
            "--leader-elect=false",
        ]
        if name == "kube-controller-manager":
            argv += [
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
            ]
        startup.start(name, argv)
    startup.wait(
        "controller-manager and scheduler healthy",
        lambda: (
            _https_ok_insecure(f"https://127.0.0.1:{ports.controller_manager}/healthz")
            and _https_ok_insecure(f"https://127.0.0.1:{ports.scheduler}/healthz")
        ),
    )

    startup.start(
        "kwok",
        [
            str(bin_dir / "kwok"),
            f"--kubeconfig={cluster.kubeconfig}",
            f"--config={STAGES_FILE}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            "--node-lease-duration-seconds=40",
            "--node-ip=127.0.0.1",
            f"--server-address=127.0.0.1:{ports.kwok}",
        ],
    )
    for name, pod_cidr in zip(cluster.nodes, cluster.pod_cidrs, strict=True):
        admin.request("POST", "/api/v1/nodes", body=node_manifest(name, pod_cidr))
    # Registered before kube-proxy, which proxies for node 0, and before their kubelets start.
    for node in cluster.real_nodes:
        admin.request("POST", "/api/v1/nodes", body=realnodes.node_manifest(node))
    startup.wait(
        f"{len(cluster.nodes)} kwok node(s) Ready",
        lambda: all(_node_ready(admin, name) for name in cluster.nodes),
    )

    # The real nodes before kube-proxy, which proxies for node 0: kube-proxy waits (30 s) for
    # its node to have an address, which the kubelet reports. One kube-proxy serves them all:
    # they share the host's network namespace, where its rules are.
    for node in cluster.real_nodes:
        _start_node(cluster, startup, node, bin_dir=bin_dir, pause_archive=pause_archive)

    proxy_config = state_dir / "kube-proxy.yaml"
    proxy_config.write_text(
        yaml.safe_dump(
            kube_proxy_config(
                cluster,
                kubeconfig=clientconfigs.write(
                    state_dir / "kube-proxy.kubeconfig",
                    server=cluster.server,
                    pki=pki,
                    identity=certificates.KUBE_PROXY,
                ),
            )
        )
    )
    startup.start("kube-proxy", [str(bin_dir / "kube-proxy"), f"--config={proxy_config}"])
    startup.wait(
        "kube-proxy synced",
        lambda: _http_ok(f"http://127.0.0.1:{ports.kube_proxy_healthz}/healthz", expect=""),
    )

    # Pods are rejected until the namespace's service account exists.
    startup.wait(
        "default service account",
        lambda: bool(admin.get("/api/v1/namespaces/default/serviceaccounts/default")),
    )


def _start_node(
    cluster: Cluster,
    startup: _Startup,
    node: realnodes.Node,
    *,
    bin_dir: Path,
    pause_archive: Path,
) -> None:
    """containerd with the pause image imported, the Node registered, then its kubelet."""
    runc = shutil.which("runc")
    if runc is None:  # realnodes.prepare said so already; this keeps the type checker informed
        raise ClusterError("runc is not installed")
    node.containerd_config.write_text(
        realnodes.containerd_config(
            node,
            shim=bin_dir / "containerd-shim-runc-v2",
            runc=Path(runc),
            sandbox_image=pauseimages.image_name(),
        )
    )
    environment = realnodes.environment(bin_dir, os.environ)
    containerd, kubelet = node.component("containerd"), node.component("kubelet")
    startup.start(
        containerd, realnodes.containerd_argv(node, containerd=bin_dir / "containerd"),
        env=environment,
    )  # fmt: skip
    startup.wait(
        f"{containerd} serving",
        lambda: _ctr_ok(bin_dir / "ctr", node.containerd_socket),
        timeout=30,
        log_of=containerd,
    )
    realnodes.import_image(node, ctr=bin_dir / "ctr", archive=pause_archive)
    startup.say(f"  pause image imported into {node.name}: {time.monotonic() - startup.t0:.1f} s")

    admin = cluster.client()
    clientconfigs.write(
        node.kubelet_kubeconfig, server=cluster.server, pki=cluster.pki, identity=node.identity
    )
    node.kubelet_config.write_text(
        yaml.safe_dump(realnodes.kubelet_config(node, pki=cluster.pki), sort_keys=False)
    )
    startup.start(
        kubelet, realnodes.kubelet_argv(node, kubelet=bin_dir / "kubelet"), env=environment
    )
    startup.wait(
        f"node {node.name} Ready",
        lambda: _node_ready(admin, node.name),
        timeout=120,
        log_of=kubelet,
    )


def restart_node(cluster: Cluster, *, say: Callable[[str], None] = print) -> None:
    """Start the real node's containerd and kubelet again (after a crash and ``realnodes.clean``
    with the bridge kept) and wait until the node is Ready."""
    startup = _Startup(cluster, say=say)
    try:
        realnodes.prepare(cluster.node, routes=HOST_ROUTES)
        _start_node(
            cluster,
            startup,
            cluster.node,
            bin_dir=building.require_binaries(),
            pause_archive=pauseimages.build(),
        )
    except (realnodes.NodeError, pauseimages.PauseImageError) as error:
        raise ClusterError(str(error)) from None


def _ctr_ok(ctr: Path, socket: Path) -> bool:
    completed = subprocess.run(
        [str(ctr), "--address", str(socket), "version"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    return completed.returncode == 0


def restart(cluster: Cluster, component: str, *, down_seconds: float = 0.0) -> float:
    """Restart etcd, kube-apiserver, or the real node's kubelet or containerd, down for
    `down_seconds`, and wait until it serves again; the seconds it was away. Everything else (the
    operator, kwok, kube-proxy, the node's running containers) must find its way back on its
    own."""
    node = cluster.node
    bin_dir = building.require_binaries()
    healthy: dict[str, Callable[[], bool]] = {
        "etcd": lambda: _http_ok(
            f"http://127.0.0.1:{cluster.ports.etcd_client}/health", expect='"true"'
        ),
        "kube-apiserver": lambda: cluster.client().text("/readyz").strip() == "ok",
        "kubelet": lambda: _http_ok(
            f"http://127.0.0.1:{node.kubelet_healthz_port}/healthz", expect="ok"
        ),
        "containerd": lambda: _ctr_ok(bin_dir / "ctr", node.containerd_socket),
    }
    if component not in healthy:
        raise ClusterError(f"cannot restart {component!r}: one of {sorted(healthy)}")
    on_the_node = component in ("kubelet", "containerd")
    stopped_at = time.monotonic()
    process = processes.restart(
        cluster.state_dir,
        component,
        down_seconds=down_seconds,
        env=realnodes.environment(bin_dir, os.environ) if on_the_node else None,
    )
    deadline = stopped_at + down_seconds + 60
    while True:
        if process.poll() is not None:
            raise ClusterError(f"{component} exited with {process.returncode} after a restart")
        with contextlib.suppress(OSError, rest.ApiError, ValueError, subprocess.SubprocessError):
            if healthy[component]() and cluster.client().text("/readyz").strip() == "ok":
                return time.monotonic() - stopped_at
        if time.monotonic() > deadline:
            raise ClusterError(f"{component} not back within 60 s of its restart")
        time.sleep(0.2)


def stop_order(state_dir: Path) -> tuple[str, ...]:
    """The components in the order they stop: every real node's kubelet (each would restart
    what its containerd loses), then every containerd, then the rest, the lock last."""
    recorded = sorted(path.stem for path in (state_dir / "pids").glob("*.pid"))
    node_programs = ("kubelet", "containerd")
    of_other_nodes = {
        program: [name for name in recorded if name.startswith(f"{program}-")]
        for program in node_programs
    }
    return (
        *(name for program in node_programs for name in (*of_other_nodes[program], program)),
        *(name for name in reversed(COMPONENTS) if name not in node_programs),
    )


def stop(
    *,
    state_dir: Path | None = None,
    keep_logs: bool = False,
    say: Callable[[str], None] = print,
) -> None:
    """Stop everything that belongs to state_dir and delete it (keeping logs/ if asked)."""
    state_dir = (state_dir or locations.state_dir()).resolve()
    if not state_dir.exists():
        say(f"nothing to stop in {state_dir}")
        return
    t0 = time.monotonic()
    processes.stop_recorded(state_dir, stop_order(state_dir))
    leftovers = processes.sweep(state_dir)
    if leftovers:
        say(f"killed leftover processes {leftovers}")
    # The pod network, the real node's bridge and cgroups are the machine's, found by name:
    # leave them alone while another cluster holds the network or has processes running.
    network_free = podnetwork.holder() is None and not processes.other_owners(state_dir)
    # Node 0 last: it puts back the host's settings that every kubelet shares.
    for index in reversed(range(realnodes.MAX_REAL_NODES)):
        node = realnodes.nth(index, state_dir=state_dir, pod_cidr=real_node_pod_cidr(index))
        if not (network_free or node.directory.exists()):
            continue
        try:
            cleaned = realnodes.clean_node(node, machine_wide=network_free).summary()
        except realnodes.NodeError as error:
            say(f"{node.name}'s cleanup left something: {error}")
        else:
            if cleaned:
                say(f"removed {node.name}'s {cleaned}")
        left = realnodes.leftovers(node)
        if left and network_free:
            say(f"{node.name} left {left}")
    if network_free:
        removed = podnetwork.release(HOST_ROUTES)
        if removed:
            say(f"removed network namespaces: {', '.join(removed)}")
    for entry in state_dir.iterdir():
        if keep_logs and entry.name == "logs":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if not keep_logs:
        state_dir.rmdir()
    say(
        f"stopped in {time.monotonic() - t0:.1f} s"
        + (f"; logs kept in {state_dir / 'logs'}" if keep_logs else "")
    )


@contextlib.contextmanager
def running(
    *,
    state_dir: Path | None = None,
    nodes: int = 1,
    real_nodes: int = 1,
    keep_logs: bool = True,
    say: Callable[[str], None] = print,
) -> Iterator[Cluster]:
    """A cluster for the duration of a with-block, stopped on errors, SIGINT and SIGTERM too."""
    restore = procfs.raise_on_sigterm()
    try:
        cluster = start(state_dir=state_dir, nodes=nodes, real_nodes=real_nodes, say=say)
        try:
            yield cluster
        finally:
            stop(state_dir=cluster.state_dir, keep_logs=keep_logs, say=say)
    finally:
        restore()
