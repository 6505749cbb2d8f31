"""Pods on the cluster's real node: containerd runs their containers, CNI gives them addresses,
the kubelet judges their readiness, kube-proxy routes Services to them, and a crash of the node
leaves nothing behind once cleaned."""

import ipaddress
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchpilot.kube import pods
from batchpilot_cluster import building, controlplane, podnetwork, processes, realnodes
from batchpilot_testbed import clients, fleet, namespaces, nodeimages, waiting, webpods
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.webpods import PORT, web_pod

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def node_image(kube: Kube) -> str:
    """A Python image imported into the real node's containerd; its reference."""
    if kube.local is None:
        pytest.skip("needs the local cluster's real node")
    image = nodeimages.python_image()
    started = time.monotonic()
    realnodes.import_image(
        kube.local.node, ctr=building.require_binaries() / "ctr", archive=image.archive
    )
    print(f"\nimported {image.reference} in {time.monotonic() - started:.1f} s")
    return image.reference


def conditions(kube: Kube, namespace: str, name: str) -> dict[str, str]:
    status = kube.core.read_namespaced_pod(name, namespace).status
    return {c.type: c.status for c in (status.conditions if status else None) or []}


def pod_ip(kube: Kube, namespace: str, name: str) -> str | None:
    status = kube.core.read_namespaced_pod(name, namespace).status
    return status.pod_ip if status and status.phase == "Running" else None


def http_get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read().decode(errors='replace')}"


@pytest.mark.timeout(180)
def test_a_pod_on_the_real_node_serves_from_its_cni_ip_and_is_ready_only_with_its_gate(
    kube: Kube, namespace: str, node_image: str, client_host: podnetwork.Host
) -> None:
    created = time.monotonic()
    kube.core.create_namespaced_pod(namespace, web_pod("web", node_image, gates=(pods.GATE,)))
    ip = waiting.wait_for(
        "the Pod Running with an IP", lambda: pod_ip(kube, namespace, "web"), timeout=90
    )
    pod = kube.core.read_namespaced_pod("web", namespace)
    assert pod.spec is not None
    assert pod.spec.node_name == realnodes.NAME
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(controlplane.REAL_NODE_POD_CIDR)
    waiting.wait_for(
        "the kubelet's probe to pass",
        lambda: conditions(kube, namespace, "web").get("ContainersReady") == "True",
        timeout=60,
    )
    print(f"\ncreated to ContainersReady: {time.monotonic() - created:.1f} s")
    # The container serves on its CNI address, reached from the host over the node's bridge.
    assert http_get(f"http://{ip}:{PORT}/") == "web"
    # The kubelet holds Ready back until the gate's owner says so, and then follows it.
    held = conditions(kube, namespace, "web")
    assert held.get("Ready") == "False", held
    body = {"status": {"conditions": [{"type": pods.GATE, "status": "True"}]}}
    kube.core.patch_namespaced_pod_status("web", namespace, body)
    waiting.wait_for(
        "Ready once the gate is True",
        lambda: conditions(kube, namespace, "web").get("Ready") == "True",
        timeout=30,
    )
    # In-cluster configuration: the kubernetes Service leads to the API server.
    assert kube.local is not None
    assert http_get(f"http://{ip}:{PORT}/api-version") == kube.local.kubernetes_version

    service_ip = webpods.create_service(kube, namespace)
    waiting.wait_for(
        "the Pod behind the Service",
        lambda: fleet.ready_endpoints(kube, namespace, "web") == {ip},
    )

    def routed() -> bool:
        return clients.probe(client_host, f"http://{service_ip}/", count=1) == {"web": 1}

    # kube-proxy's rules follow the endpoints a moment later.
    waiting.wait_for("kube-proxy to route the Service", routed, timeout=20, interval=0.5)
    assert clients.probe(client_host, f"http://{service_ip}/", count=5) == {"web": 5}


@pytest.mark.timeout(180)
def test_service_routes_new_connections_to_ready_pods_only_and_follows_the_gate(
    kube: Kube, namespace: str, node_image: str, client_host: podnetwork.Host
) -> None:
    """Through kube-proxy, from a client namespace: no Ready Pod, no answer; then only the
    Pods whose readiness gate is True answer, and a Pod whose gate goes False stops answering."""
    names = ("echo-0", "echo-1")
    for name in names:
        kube.core.create_namespaced_pod(namespace, web_pod(name, node_image, gates=(pods.GATE,)))

    def serving() -> bool:
        return all(
            conditions(kube, namespace, name).get("ContainersReady") == "True" for name in names
        )

    waiting.wait_for("both Pods serving", serving, timeout=90)
    url = f"http://{webpods.create_service(kube, namespace)}/"

    def answered_by(*expected: str, count: int = 12) -> bool:
        return set(clients.probe(client_host, url, count=count)) == set(expected)

    time.sleep(2)  # kube-proxy has long had the Service; its endpoints are all unready
    assert set(clients.probe(client_host, url, count=4)) == {"error: URLError"}
    set_gate(kube, namespace, "echo-0", "True")
    waiting.wait_for("only echo-0 answering", lambda: answered_by("echo-0"), timeout=20)
    set_gate(kube, namespace, "echo-1", "True")
    waiting.wait_for("both answering", lambda: answered_by(*names, count=30), timeout=20)
    gate_closed = time.monotonic()
    set_gate(kube, namespace, "echo-0", "False")
    waiting.wait_for(
        "only echo-1 answering", lambda: answered_by("echo-1"), timeout=20, interval=0.05
    )
    print(f"\nthe Service stopped routing to echo-0 {time.monotonic() - gate_closed:.2f}s after")
    assert answered_by("echo-1", count=30)


def set_gate(kube: Kube, namespace: str, pod: str, status: str) -> None:
    body = {"status": {"conditions": [{"type": pods.GATE, "status": status}]}}
    kube.core.patch_namespaced_pod_status(pod, namespace, body)


def _crash(cluster: controlplane.Cluster) -> None:
    """SIGKILL the kubelet, containerd and every shim, as a crash of the node would: the Pods'
    containers keep running, their mounts, cgroups and network namespaces stay."""
    for name in ("kubelet", "containerd"):
        pid = int((cluster.state_dir / "pids" / f"{name}.pid").read_text())
        if processes.is_owned(pid, cluster.state_dir):
            os.killpg(pid, signal.SIGKILL)
    shim = building.require_binaries() / "containerd-shim-runc-v2"
    for pid in processes.owned_pids(cluster.state_dir):
        try:
            executable = Path(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if executable == shim:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def crashed_node(kube: Kube) -> Iterator[controlplane.Cluster]:
    """The real node, crashed by the test, restarted afterwards for the tests that follow (with
    an empty containerd: images imported before are gone with its root)."""
    if kube.local is None:
        pytest.skip("needs the local cluster's real node")
    yield kube.local
    controlplane.restart_node(kube.local)


@pytest.mark.timeout(240)
@pytest.mark.cluster_wide  # checks that no cgroup of any node is left on the host
def test_a_crashed_node_is_cleaned_from_its_names_alone(
    kube: Kube, node_image: str, crashed_node: controlplane.Cluster
) -> None:
    node = crashed_node.node
    name = namespaces.unique("e2e-node-crash")
    with namespaces.created(kube, name, label="batchpilot.dev/e2e"):
        kube.core.create_namespaced_pod(name, web_pod("web", node_image))
        ip = waiting.wait_for("the Pod Running", lambda: pod_ip(kube, name, "web"), timeout=90)
        waiting.wait_for("it serves", lambda: fleet.answers(f"http://{ip}:{PORT}/"))
        before = realnodes.leftovers(node)
        assert set(before) == {"mounts", "cgroups", "links", "netns"}, before
        veths = realnodes.bridge_ports(node.bridge)
        assert veths

        _crash(crashed_node)
        assert fleet.answers(f"http://{ip}:{PORT}/")  # the container outlives its node
        cleaned = realnodes.clean(node.directory, keep_bridge=True)
        print(f"\ncleaned: {cleaned.summary()}")

        assert realnodes.leftovers(node) == {"links": [node.bridge]}  # the API server's
        assert realnodes.bridge_ports(node.bridge) == []
        assert not any(Path("/sys/fs/cgroup").glob(f"*/{realnodes.CGROUP_ROOT}"))
        assert not node.directory.exists()
        assert not fleet.answers(f"http://{ip}:{PORT}/")
        assert not [pid for pid in cleaned.killed if Path(f"/proc/{pid}").exists()], (
            "the Pod's processes outlived the cleanup"
        )
        kube.core.delete_namespaced_pod("web", name, grace_period_seconds=0)


def test_the_node_reports_its_versions(kube: Kube) -> None:
    if kube.local is None:
        pytest.skip("needs the local cluster's real node")
    node = kube.core.read_node(realnodes.NAME)
    assert node.status is not None
    assert node.status.node_info is not None
    info = node.status.node_info
    versions = {"kubelet": info.kubelet_version, "runtime": info.container_runtime_version}
    print(f"\n{json.dumps(versions)}")
    assert info.kubelet_version == kube.local.kubernetes_version
    assert info.container_runtime_version.startswith("containerd://2.")


def test_the_node_weighs_as_much_as_the_host_s_cores_against_its_processes(kube: Kube) -> None:
    """Its Pods compete with the host's processes (the local lane's Tritons, a vLLM engine) as a
    machine of that many cores would, not as one process."""
    if kube.local is None:
        pytest.skip("needs the local cluster's real node")
    hierarchies = [h for h in realnodes.cgroup_hierarchies() if (h / "cpu.shares").exists()]
    if not hierarchies:
        pytest.skip("no cgroup v1 cpu controller on this host")
    cores = os.cpu_count() or 1
    for hierarchy in hierarchies:
        shares = hierarchy / kube.local.node.cgroup_root / "cpu.shares"
        assert int(shares.read_text()) == realnodes.node_cpu_shares() == 1024 * cores
