"""Replicas from the API's Pods: endpoints, named ports, the readiness gate."""

from __future__ import annotations

from typing import Any

from batchpilot.applying.replicas import ServingContainer
from batchpilot.kube import pods
from batchpilot.policy import specs


def pod(
    name: str, *, phase: str = "Running", ip: str | None = "10.88.0.7", **extra: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", **extra.get("metadata", {})},
        "spec": {
            "containers": [
                {
                    "name": "triton",
                    "ports": [
                        {"name": "http", "containerPort": 8100},
                        {"name": "sidecar", "containerPort": 9400},
                    ],
                }
            ],
            "readinessGates": extra.get("gates", []),
        },
        "status": {"phase": phase, "podIP": ip, "conditions": extra.get("conditions", [])},
    }


def target_spec(**fields: Any) -> specs.Target:
    return specs.Target.model_validate({"selector": {"matchLabels": {"app": "triton"}}, **fields})


def test_named_ports_resolve_and_pods_without_ip_or_running_are_skipped() -> None:
    found, skipped = pods.replicas_from_pods(
        [
            pod("b"),
            pod("a"),
            pod("pending", phase="Pending"),
            pod("no-ip", ip=None),
            pod("leaving", metadata={"deletionTimestamp": "2026-11-24T15:00:00Z"}),
        ],
        target_spec(port="http", sidecarPort="sidecar"),
    )
    assert [t.name for t in found] == ["a", "b"]
    assert found[0].http_url == "http://10.88.0.7:8100"
    assert found[0].sidecar_url == "http://10.88.0.7:9400"
    assert skipped == []


def test_a_missing_named_port_is_reported() -> None:
    found, skipped = pods.replicas_from_pods([pod("a")], target_spec(port="grpc"))
    assert found == []
    assert skipped == ["a: no container port named 'grpc'"]


def test_the_gate_is_read_from_the_pod() -> None:
    gated = pod(
        "g",
        gates=[{"conditionType": pods.GATE}],
        conditions=[{"type": pods.GATE, "status": "False"}, {"type": "Ready", "status": "False"}],
    )
    (found,), _ = pods.replicas_from_pods([gated], target_spec())
    assert (found.gated, found.gate, found.http_url) == (True, "False", "http://10.88.0.7:8000")
    assert found.title == "pod g"


def test_selector_string_speaks_the_api_query_syntax() -> None:
    selector = specs.LabelSelector.model_validate(
        {
            "matchLabels": {"app": "triton", "tier": "gpu"},
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "DoesNotExist"},
            ],
        }
    )
    assert pods.selector_string(selector) == "app=triton,tier=gpu,zone in (a,b),!canary"


def triton_and_sidecar(*statuses: dict[str, Any]) -> dict[str, Any]:
    """A gated Pod whose Triton (http) and sidecar report these container statuses."""
    found = pod("g", gates=[{"conditionType": pods.GATE}])
    found["spec"]["containers"].append({"name": "batchpilot-sidecar", "ports": []})
    found["status"]["containerStatuses"] = list(statuses)
    return found


def test_the_replica_names_the_run_of_the_container_serving_triton() -> None:
    restarted = triton_and_sidecar(
        {"name": "batchpilot-sidecar", "containerID": "containerd://s1", "state": {"running": {}}},
        {"name": "triton", "containerID": "containerd://t2", "restartCount": 1,
         "state": {"running": {"startedAt": "2026-11-26T15:00:01Z"}}},
    )  # fmt: skip
    (found,), _ = pods.replicas_from_pods([restarted], target_spec(port="http"))
    assert found.serving == ServingContainer(name="triton", run="containerd://t2")


def test_without_a_container_id_the_restart_count_and_start_time_name_the_run() -> None:
    # kwok's Pods, for one, carry no container IDs.
    started = triton_and_sidecar(
        {"name": "triton", "restartCount": 3, "state": {"running": {"startedAt": "T"}}}
    )
    (found,), _ = pods.replicas_from_pods([started], target_spec(port="http"))
    assert found.serving == ServingContainer(name="triton", run="3@T")


def test_a_serving_container_that_is_not_running_has_no_run_and_says_why() -> None:
    crashed = triton_and_sidecar(
        {"name": "triton", "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    )
    (found,), _ = pods.replicas_from_pods([crashed], target_spec(port="http"))
    assert found.serving == ServingContainer(name="triton", run="", stopped="CrashLoopBackOff")


def test_a_pod_that_reports_no_container_statuses_says_nothing_of_its_serving_container() -> None:
    (found,), _ = pods.replicas_from_pods([triton_and_sidecar()], target_spec(port="http"))
    assert found.serving is None
