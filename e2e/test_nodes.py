"""Replicas on two real nodes, as a Deployment spread over a cluster's GPU nodes runs them.

Each node has its own containerd, kubelet, bridge and podCIDR; the host routes between the
bridges and one kube-proxy serves both. The model repository is an image every node imports
(manifests/model-repository.Dockerfile), so no replica needs a volume another node holds.
"""

import ipaddress
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from batchpilot_cluster import podnetwork
from batchpilot_harness import procfs
from batchpilot_testbed import clients, fleet, hitless, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess
from batchpilot_triton import endpoints

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


def _target(app: str) -> dict[str, Any]:
    return {"selector": {"matchLabels": {"app": app}}, "port": "http", "models": [fleet.MODEL]}


def _rolled_out(kube: Kube, namespace: str, policy: str, profile: str) -> tuple[float, float]:
    """When `policy`'s rollout into `profile` ended (its RolledOut event's time, whole seconds)
    and how long it took (its message: "interactive on 2/2 targets in 12.3s (2 reloads)")."""
    for event in kube.core.list_namespaced_event(namespace).items:
        found = re.match(rf"{profile} on \d+/\d+ targets in (\d+(?:\.\d+)?)s", event.message or "")
        ours = event.reason == "RolledOut" and event.involved_object.name == policy
        if ours and found and event.last_timestamp is not None:
            return event.last_timestamp.timestamp(), float(found.group(1))
    raise AssertionError(f"no RolledOut event of {policy} into {profile}")


DRAIN_TIMEOUT = 16
"""slow's drainTimeoutSeconds: its waves outlast a reload by half of it, on average."""


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("spread")  # skips without two real nodes
def test_a_policy_plans_for_a_longer_rollout_beside_it_on_its_node_and_not_on_another(
    kube: Kube,
    namespace: str,
    client_host: podnetwork.Host,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    """leadTime auto plans a wave as long as the longest that ran beside the policy's own on its
    nodes: reloads on one node share its cores and GPUs. Three policies switch at once. `slow`
    (two replicas on node 1, a client keeping its connection to one of them, so that one's
    drain runs to its timeout) has the longest wave; `beside` (one replica on node 1)
    plans for it; `apart` (one replica on node 0), switching at the same time on the other
    node, plans for its own."""
    node_0, node_1 = fleet.on_real_node(kube, 0), fleet.on_real_node(kube, 1)
    slow = fleet.start_tritons(kube, namespace, 2, gated=True, labels={"app": "slow"},
                               prefix="slow", where=node_1)  # fmt: skip
    beside = fleet.start_tritons(kube, namespace, 1, labels={"app": "beside"}, prefix="beside",
                                 where=node_1)  # fmt: skip
    apart = fleet.start_tritons(kube, namespace, 1, labels={"app": "apart"}, prefix="apart",
                                where=node_0)  # fmt: skip
    service_ip = fleet.create_service(kube, namespace, selector={"app": "slow"}, name="slow")
    start_operator(interval=2.0)
    specs: dict[str, dict[str, Any]] = {
        "slow": {
            "target": _target("slow"),
            "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": DRAIN_TIMEOUT},
        },
        "beside": {"target": _target("beside")},
        "apart": {"target": _target("apart")},
    }
    for name, spec in specs.items():
        operators.apply_policy(kube, namespace, fleet.policy(name, **spec))
    every = {**slow, **beside, **apart}
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(every, "bulk"), timeout=90)
    waiting.wait_for(
        "both slow Pods behind their Service",
        lambda: fleet.ready_endpoints(kube, namespace, "slow") == set(slow.values()),
        timeout=30,
    )

    load = clients.ClientProcess(
        client_host,
        style="one-connection",
        address=f"{service_ip}:{endpoints.TRITON_HTTP_PORT}",
        rate=20,
        seed=3,
    )
    with load:
        load.start()
        time.sleep(2)  # the client's one connection is open, on one of the slow Pods
        for name, spec in specs.items():
            overridden = fleet.policy(name, **spec, override={"profile": "interactive"})
            operators.apply_policy(kube, namespace, overridden)
        waiting.wait_for(
            "interactive everywhere", fleet.everyone_serves(every, "interactive"), timeout=120
        )
        load.stop()

    def planned(name: str) -> float | None:
        seconds = operators.policy_status(kube, namespace, name).get("measuredWaveSeconds")
        return float(seconds) if seconds is not None else None

    def slow_measured() -> float | None:
        # A wave of `slow` is one of its two reloads and, on average, half of the drain.
        seconds = planned("slow")
        return seconds if seconds is not None and seconds >= DRAIN_TIMEOUT / 2 else None

    slowest = waiting.wait_for("slow's long waves measured", slow_measured, timeout=30)
    waiting.wait_for(
        "beside to plan for slow's wave", lambda: planned("beside") == slowest, timeout=30
    )
    ended = {name: _rolled_out(kube, namespace, name, "interactive") for name in specs}
    print(f"\nplanned waves: { {name: planned(name) for name in specs} }; rollouts: {ended}")
    # apart's rollout ran while slow's did (whole-second event times), on the other node.
    (slow_end, slow_took), (apart_end, apart_took) = ended["slow"], ended["apart"]
    assert apart_end >= slow_end - slow_took - 1
    assert apart_end - apart_took <= slow_end + 1
    apart_planned = planned("apart")
    assert apart_planned is not None
    assert apart_planned < slowest
