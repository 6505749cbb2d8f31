"""The test cluster does what the operator's e2e tests will rely on."""

import ipaddress
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from kubernetes import client

from batchpilot.kube import pods
from batchpilot_cluster import controlplane, podnetwork, podsandboxes, processes
from batchpilot_testbed import clients, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import endpoints

pytestmark = pytest.mark.e2e


def pod_manifest(
    name: str, *, annotations: dict[str, str] | None = None, gates: tuple[str, ...] = ()
) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, annotations=annotations),
        spec=pod_spec(gates=gates),
    )


def pod_spec(*, gates: tuple[str, ...] = ()) -> client.V1PodSpec:
    return client.V1PodSpec(
        # kwok never pulls it; an unresolvable registry makes sure nothing else does either.
        containers=[client.V1Container(name="main", image="registry.invalid/batchpilot/none:0")],
        termination_grace_period_seconds=5,
        readiness_gates=[client.V1PodReadinessGate(condition_type=gate) for gate in gates] or None,
    )


def condition(status: client.V1PodStatus | client.V1NodeStatus | None, kind: str) -> str | None:
    for item in (status.conditions if status else None) or []:
        if item.type == kind:
            return str(item.status)
    return None


def running_pod(kube: Kube, namespace: str, name: str) -> client.V1Pod:
    def check() -> client.V1Pod | None:
        pod = kube.core.read_namespaced_pod(name, namespace)
        return pod if pod.status and pod.status.phase == "Running" and pod.status.pod_ip else None

    return waiting.wait_for(f"pod {namespace}/{name} Running with an IP", check)


def pod_ip(pod: client.V1Pod) -> str:
    assert pod.status
    assert pod.status.pod_ip
    return pod.status.pod_ip


def set_gate(kube: Kube, namespace: str, pod: str, status: str) -> None:
    body = {"status": {"conditions": [{"type": pods.GATE, "status": status}]}}
    kube.core.patch_namespaced_pod_status(pod, namespace, body)


@pytest.mark.timeout(30)
def test_api_server_is_ready_and_a_kwok_node_is_ready(kube: Kube) -> None:
    assert kube.kubectl("get", "--raw=/readyz").strip() == "ok"
    nodes = kube.core.list_node(label_selector="type=kwok").items
    assert nodes, "no kwok nodes"
    assert all(condition(node.status, "Ready") == "True" for node in nodes)


@pytest.mark.timeout(60)
def test_deployment_gets_two_running_pods_with_their_own_ips(kube: Kube, namespace: str) -> None:
    labels = {"app": "pause"}
    deployment = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="pause"),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels), spec=pod_spec()
            ),
        ),
    )
    kube.apps.create_namespaced_deployment(namespace, deployment)

    def two_running() -> list[client.V1Pod] | None:
        listed = kube.core.list_namespaced_pod(namespace, label_selector="app=pause").items
        running = [p for p in listed if p.status and p.status.phase == "Running"]
        return running if len(running) == 2 else None

    replicas = waiting.wait_for("2 running replicas", two_running)
    assert len({pod_ip(pod) for pod in replicas}) == 2


@pytest.mark.timeout(60)
def test_readiness_gate_holds_ready_until_its_condition_is_true(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, pod_manifest("gated", gates=(pods.GATE,)))
    pod = running_pod(kube, namespace, "gated")
    assert condition(pod.status, "ContainersReady") == "True"
    assert condition(pod.status, pods.GATE) is None  # kwok's own stages would have faked it True
    assert condition(pod.status, "Ready") == "False"

    def ready_is(expected: str) -> bool:
        return fleet.pod_condition(kube, namespace, "gated", "Ready") == expected

    set_gate(kube, namespace, "gated", "True")
    waiting.wait_for("Ready=True after the gate passed", lambda: ready_is("True"), timeout=15)
    set_gate(kube, namespace, "gated", "False")
    waiting.wait_for("Ready=False after the gate failed", lambda: ready_is("False"), timeout=15)


@pytest.mark.timeout(60)
def test_pod_without_gates_becomes_ready(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, pod_manifest("plain"))
    running_pod(kube, namespace, "plain")
    waiting.wait_for(
        "Ready=True", lambda: fleet.pod_condition(kube, namespace, "plain", "Ready") == "True"
    )


@pytest.mark.timeout(120)
def test_triton_pod_is_running_and_answers_inference_on_its_pod_ip(
    kube: Kube, local_cluster: controlplane.Cluster, namespace: str
) -> None:
    ips = fleet.start_tritons(kube, namespace, 1)
    (ip,) = ips.values()
    pod = kube.core.read_namespaced_pod("triton-0", namespace)
    assert pod.status is not None
    assert pod.status.phase == "Running"
    assert not ipaddress.ip_address(ip).is_loopback
    body = json.dumps(
        {"inputs": [{"name": "INPUT", "shape": [2, 16], "datatype": "FP32", "data": [0.5] * 32}]}
    ).encode()
    request = urllib.request.Request(
        f"{fleet.triton_url(ip)}/v2/models/{fleet.MODEL}/infer",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        answer = json.loads(response.read())
    (output,) = answer["outputs"]
    assert output["shape"] == [2, 16]
    assert output["data"][0] == pytest.approx(0.4621, abs=1e-3)  # tanh(0.5)


@pytest.mark.timeout(120)
def test_triton_pod_can_ask_for_a_grpc_max_connection_age(
    kube: Kube, local_cluster: controlplane.Cluster, namespace: str
) -> None:
    """The annotation reaches tritonserver's flags, and a gRPC client keeps being served across
    the connections the server ends."""
    ips = fleet.start_tritons(kube, namespace, 1, grpc_max_connection_age_ms=500)
    (ip,) = ips.values()
    server = fleet.process_in_pod(ip, "tritonserver")
    flags = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    assert b"--grpc-max-connection-age=500" in flags
    triton = grpcclient.InferenceServerClient(f"{ip}:{endpoints.TRITON_GRPC_PORT}")
    item = grpcclient.InferInput("INPUT", [1, 16], "FP32")
    item.set_data_from_numpy(np.full((1, 16), 0.5, dtype=np.float32))
    answered = 0
    until = time.monotonic() + 2.5  # five connection ages
    while time.monotonic() < until:
        result = triton.infer(fleet.MODEL, [item], client_timeout=10)
        assert result.as_numpy("OUTPUT") is not None
        answered += 1
        time.sleep(0.05)
    triton.close()
    assert answered > 20


def _tcp_peers(pid: int) -> set[str]:
    """The remote addresses of the process's TCP connections (in its network namespace)."""
    try:
        inodes = {
            os.readlink(link).removeprefix("socket:[").removesuffix("]")
            for link in Path(f"/proc/{pid}/fd").iterdir()
            if os.readlink(link).startswith("socket:[")
        }
        tables = [Path(f"/proc/{pid}/net/{name}").read_text() for name in ("tcp", "tcp6")]
    except OSError:  # it ended meanwhile
        return set()
    peers = set()
    for row in (line.split() for table in tables for line in table.splitlines()[1:]):
        remote, state, inode = row[2], row[3], row[9]
        if inode in inodes and state != "0A":  # not a listening socket
            peers.add(str(_proc_address(remote.split(":")[0])))
    return peers


def _proc_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(swapped) == 4:
        return ipaddress.IPv4Address(swapped)
    address = ipaddress.IPv6Address(swapped)
    return address.ipv4_mapped or address


@pytest.mark.timeout(180)
def test_pods_have_namespaces_of_their_own_and_traffic_stays_among_the_run_s_hosts(
    kube: Kube,
    local_cluster: controlplane.Cluster,
    namespace: str,
    client_host: podnetwork.Host,
    start_operator: Callable[..., operators.OperatorProcess],
) -> None:
    """No Pod address on the host's lo or any host interface; each Pod IP on the eth0 of a
    network namespace of its own, behind the real node's bridge; a client's behind a veth of the
    run; no default route in any namespace; and every TCP connection of the run's processes
    (control plane, the node, Pods, the operator, a client through a Service, this test) goes to
    loopback, the gateway, a namespace of the run or a Service IP."""
    ips = fleet.start_tritons(kube, namespace, 2)
    service_ip = fleet.create_service(kube, namespace, selector={"app": "triton"})
    waiting.wait_for(
        "the Pods behind the Service",
        lambda: fleet.ready_endpoints(kube, namespace, "triton") == set(ips.values()),
    )
    operator = start_operator(interval=1.0)
    policy = {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "metadata": {"name": "fleet"},
        "spec": {
            "target": {"selector": {"matchLabels": {"app": "triton"}}, "models": [fleet.MODEL]},
            "profiles": fleet.PROFILES,
            "defaultProfile": "bulk",
        },
    }
    operators.apply_policy(kube, namespace, policy)
    peers: set[str] = set()
    address = f"{service_ip}:{endpoints.TRITON_HTTP_PORT}"
    with clients.ClientProcess(client_host, style="keep-alive", address=address, rate=50) as load:
        load.start()
        waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
        for _ in range(6):
            run = set(processes.owned_pids(local_cluster.state_dir))
            run |= {pid for host in podnetwork.hosts() for pid in podnetwork.pids(host)}
            run |= {pid for ip in ips.values() for pid in podsandboxes.pids(ip)}
            run |= {os.getpid(), operator.process.pid}
            for pid in run:
                peers |= _tcp_peers(pid)
            time.sleep(0.5)
        records = load.stop()
    assert records
    assert all(record.succeeded for record in records)

    pod_network = ipaddress.ip_network(controlplane.HOST_ROUTES[0])
    service_range = ipaddress.ip_network(controlplane.HOST_ROUTES[1])
    shown = json.loads(subprocess.run(["ip", "-json", "addr"], capture_output=True,
                                      check=True).stdout)  # fmt: skip
    real_node = local_cluster.node
    real_nodes = local_cluster.real_nodes
    gateways = {(node.bridge, node.gateway) for node in real_nodes}
    for link in shown:
        for info in link.get("addr_info", []):
            address_on_host = ipaddress.ip_address(info["local"])
            if link["ifname"] == "lo":
                assert address_on_host.is_loopback, f"{address_on_host} on the host's lo"
            if (link["ifname"], str(address_on_host)) in gateways:
                continue  # a real node's gateway (node 0's: where the API server listens)
            assert address_on_host not in pod_network, f"{address_on_host} on {link['ifname']}"
            assert address_on_host not in service_range

    ours = {host.ip: host for host in podnetwork.hosts()}  # the clients'
    assert client_host.ip in ours
    namespaces_shown = [
        (host.ip, ["ip", "-n", host.netns], podnetwork.GATEWAY) for host in ours.values()
    ] + [
        (ip, ["nsenter", f"--net=/proc/{podsandboxes.pids(ip)[0]}/ns/net", "ip"], real_node.gateway)
        for ip in ips.values()
    ]
    for ip, ip_command, gateway in namespaces_shown:
        inside = json.loads(subprocess.run([*ip_command, "-json", "addr"],
                                           capture_output=True, check=True).stdout)  # fmt: skip
        held = {(link["ifname"], info["local"]) for link in inside for info in link["addr_info"]}
        assert {a for a in held if a[0] == "eth0" and "." in a[1]} == {("eth0", ip)}
        routes = json.loads(subprocess.run([*ip_command, "-4", "-json", "route"],
                                           capture_output=True, check=True).stdout)  # fmt: skip
        # The run's networks through the gateway; no default route.
        assert "default" not in {route["dst"] for route in routes}, routes
        assert {route["dst"] for route in routes if route.get("gateway") == gateway} == set(
            controlplane.HOST_ROUTES
        ), routes

    host_routes = json.loads(subprocess.run(["ip", "-4", "-json", "route"], capture_output=True,
                                            check=True).stdout)  # fmt: skip
    for route in host_routes:
        destination = route["dst"]
        if destination == "default" or route.get("type") == "unreachable":
            continue
        network = ipaddress.ip_network(destination)
        assert not network.overlaps(service_range), route
        bridges = {node.pod_cidr: node.bridge for node in real_nodes}
        if destination in bridges:  # a real node's Pods, on its bridge
            assert route["dev"] == bridges[destination], route
            continue
        if network.overlaps(pod_network):  # a Pod's or a client's, through its own veth
            assert destination in ours, route
            assert route["dev"] == ours[destination].link, route

    allowed = {podnetwork.GATEWAY, *(node.gateway for node in real_nodes), *ours}
    real_pods = [ipaddress.ip_network(node.pod_cidr) for node in real_nodes]  # kubelets probe
    strangers = {
        peer
        for peer in peers
        if not ipaddress.ip_address(peer).is_loopback
        and peer not in allowed
        and ipaddress.ip_address(peer) not in service_range
        and not any(ipaddress.ip_address(peer) in pods for pods in real_pods)
    }
    print(f"\nTCP peers of the run: {sorted(peers)}")
    assert not strangers, f"connections to {strangers}"
    assert service_ip in peers, "the client's connections through the Service were not seen"
    assert set(ips.values()) <= peers, "the operator's connections to the Pods were not seen"
