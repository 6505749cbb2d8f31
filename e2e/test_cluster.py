"""The test cluster does what the operator's e2e tests will rely on."""

import ipaddress
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from batchpilot.kube import pods
from e2e import fleet, waiting
from e2e.cluster import controlplane, podnetwork, podrunner
from e2e.kubes import Kube

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


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, OSError):
        return None


def listening(ip: str, port: int) -> bool:
    """Whether a local socket listens on ip:port (a TCP probe cannot tell: this machine's
    network may answer for any address that is not local)."""
    wanted = f"{int(ipaddress.IPv4Address(ip)).to_bytes(4, 'big')[::-1].hex().upper()}:{port:04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(row.split()[1] == wanted and row.split()[3] == "0A" for row in rows)


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

    def set_gate(status: str) -> None:
        body = {"status": {"conditions": [{"type": pods.GATE, "status": status}]}}
        kube.core.patch_namespaced_pod_status("gated", namespace, body)

    def ready_is(expected: str) -> bool:
        return fleet.pod_condition(kube, namespace, "gated", "Ready") == expected

    set_gate("True")
    waiting.wait_for("Ready=True after the gate passed", lambda: ready_is("True"), timeout=15)
    set_gate("False")
    waiting.wait_for("Ready=False after the gate failed", lambda: ready_is("False"), timeout=15)


@pytest.mark.timeout(60)
def test_pod_without_gates_becomes_ready(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, pod_manifest("plain"))
    running_pod(kube, namespace, "plain")
    waiting.wait_for(
        "Ready=True", lambda: fleet.pod_condition(kube, namespace, "plain", "Ready") == "True"
    )


@pytest.mark.timeout(90)
def test_http_echo_pod_answers_on_its_pod_ip_until_deleted(
    kube: Kube, local_cluster: controlplane.Cluster, namespace: str
) -> None:
    annotations = {podrunner.RUNTIME_ANNOTATION: "http-echo"}
    kube.core.create_namespaced_pod(namespace, pod_manifest("echo", annotations=annotations))
    ip = pod_ip(running_pod(kube, namespace, "echo"))
    address = ipaddress.ip_address(ip)
    assert not address.is_loopback
    assert any(address in ipaddress.ip_network(cidr) for cidr in local_cluster.pod_cidrs)

    assert ip in podnetwork.addresses_in(local_cluster.pod_cidrs)
    url = f"http://{ip}:{podrunner.ECHO_PORT}/"
    body = waiting.wait_for("an answer from the pod", lambda: http_get(url))
    assert body.strip() == f"{namespace}/echo"
    assert listening(ip, podrunner.ECHO_PORT)

    kube.core.delete_namespaced_pod("echo", namespace)

    def pod_gone() -> bool:
        try:
            kube.core.read_namespaced_pod("echo", namespace)
        except client.ApiException as error:
            return bool(error.status == 404)
        return False

    waiting.wait_for("the pod to be deleted", pod_gone)
    waiting.wait_for(
        "the process to stop", lambda: not listening(ip, podrunner.ECHO_PORT), timeout=15
    )
    assert http_get(url) is None
    waiting.wait_for(
        "the address to leave lo",
        lambda: ip not in podnetwork.addresses_in(local_cluster.pod_cidrs),
        timeout=15,
    )


@pytest.mark.timeout(60)
def test_pod_asking_for_an_unknown_runtime_gets_a_warning_and_nothing_runs(
    kube: Kube, local_cluster: controlplane.Cluster, namespace: str
) -> None:
    annotations = {podrunner.RUNTIME_ANNOTATION: "sh -c 'touch /tmp/pwned'"}
    kube.core.create_namespaced_pod(namespace, pod_manifest("evil", annotations=annotations))
    ip = pod_ip(running_pod(kube, namespace, "evil"))

    def warnings() -> list[client.CoreV1Event]:
        events = kube.core.list_namespaced_event(namespace).items
        return [e for e in events if e.reason == "E2ERejected" and e.involved_object.name == "evil"]

    (event,) = waiting.wait_for("an E2ERejected event", warnings)
    assert "unknown runtime" in (event.message or "")
    assert ip not in podnetwork.addresses_in(local_cluster.pod_cidrs)


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
