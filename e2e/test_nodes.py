"""Replicas on two real nodes, as a Deployment spread over a cluster's GPU nodes runs them.

Each node has its own containerd, kubelet, bridge and podCIDR; the host routes between the
bridges and one kube-proxy serves both. The model repository is an image every node imports
(manifests/model-repository.Dockerfile), so no replica needs a volume another node holds.
"""

import ipaddress
from collections.abc import Callable
from typing import Any

import pytest

from batchpilot_cluster import podnetwork
from batchpilot_harness import procfs
from batchpilot_testbed import fleet, hitless, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("triton_pods")]

RATE = 100
"""Requests a second through the Service: new connections, so kube-proxy picks a Pod for each."""


@pytest.fixture
def spread(kube: Kube) -> fleet.Placement:
    try:
        return fleet.spread_placement(kube)
    except fleet.PlacementError as error:
        pytest.skip(str(error))


@pytest.mark.timeout(240)
def test_replicas_on_two_nodes_read_one_image_and_switch_through_a_service_failing_nothing(
    kube: Kube,
    namespace: str,
    spread: fleet.Placement,
    client_host: podnetwork.Host,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    """One replica on each node, each reading /models from the model-repository image; the
    operator switches them one at a time, and the Service, whose endpoints sit on two nodes,
    sends no request to a replica while it reloads."""
    assert kube.local is not None  # the `spread` fixture skips elsewhere
    ips = fleet.start_tritons(kube, namespace, 2, gated=True, image_volume=True, where=spread)
    nodes = {node.name: node for node in kube.local.real_nodes}
    placed = {}
    for name, ip in ips.items():
        pod = kube.core.read_namespaced_pod(name, namespace)
        assert pod.spec is not None
        node = nodes[str(pod.spec.node_name)]
        placed[name] = node.name
        # The Pod's address is from its own node's podCIDR, on that node's bridge.
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(node.pod_cidr), (ip, node)
        options = procfs.mount_options(fleet.process_in_pod(ip, "tritonserver"), "/models")
        assert options is not None, f"nothing mounted at /models for the Triton at {ip}"
        assert "ro" in options, options
    print(f"\nplaced: {placed}")
    assert len(set(placed.values())) == 2, f"both replicas on one node: {placed}"

    service_ip = fleet.create_service(kube, namespace, selector={"app": "triton"})
    operator = start_operator(interval=2.0)
    spec: dict[str, Any] = {"rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 10}}
    operators.apply_policy(kube, namespace, fleet.policy(**spec))
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    waiting.wait_for(
        "both Pods behind the Service",
        lambda: fleet.ready_endpoints(kube, namespace, "triton") == set(ips.values()),
        timeout=30,
    )

    switched = hitless.switch_to_interactive(
        kube,
        namespace,
        ips,
        switch=lambda: operators.apply_policy(
            kube, namespace, fleet.policy(**spec, override={"profile": "interactive"})
        ),
        client_host=client_host,
        service_ip=service_ip,
        selector="app=triton",
        rate=RATE,
        seed=7,
    )
    # Each replica left its Service for its reload, and never while the one on the other node
    # was not Ready and staying.
    switched.assert_hitless(ips, rate=RATE)
    assert any(
        message.startswith("interactive on 2/2 targets")
        for message in operators.events(kube, namespace, "RolledOut")
    )
    assert operator.process.poll() is None
