"""Replicas from the API's Pods: endpoints, named ports, the readiness gate."""

from __future__ import annotations

from typing import Any

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


def gated_pod(opened: str, *containers: dict[str, Any]) -> dict[str, Any]:
    """A gated Pod whose gate turned True at `opened`, with these container statuses."""
    found = pod(
        "g",
        gates=[{"conditionType": pods.GATE}],
        conditions=[{"type": pods.GATE, "status": "True", "lastTransitionTime": opened}],
    )
    found["spec"]["containers"].append({"name": "batchpilot-sidecar", "ports": []})
    found["status"]["containerStatuses"] = list(containers)
    return found


def running(name: str, started: str, restarts: int = 0) -> dict[str, Any]:
    return {"name": name, "restartCount": restarts, "state": {"running": {"startedAt": started}}}


def test_a_serving_container_started_after_the_gate_opened_makes_the_gate_stale() -> None:
    restarted = gated_pod(
        "2026-11-26T15:00:00Z",
        running("triton", "2026-11-26T15:00:01Z", restarts=1),
        running("batchpilot-sidecar", "2026-11-26T14:59:00Z"),
    )
    (found,), _ = pods.replicas_from_pods([restarted], target_spec(port="http"))
    assert found.gate == "True"
    assert found.restarted == "container triton restarted at 2026-11-26T15:00:01Z"


def test_a_container_that_started_before_the_gate_opened_leaves_it_standing() -> None:
    serving = gated_pod(
        "2026-11-26T15:00:00Z",
        running("triton", "2026-11-26T14:58:00Z"),
        # The sidecar restarting does not touch Triton's configuration.
        running("batchpilot-sidecar", "2026-11-26T15:05:00Z", restarts=3),
    )
    (found,), _ = pods.replicas_from_pods([serving], target_spec(port="http"))
    assert found.restarted is None


def test_a_serving_container_that_is_not_running_makes_the_gate_stale() -> None:
    crashed = gated_pod(
        "2026-11-26T15:00:00Z",
        {"name": "triton", "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}}},
    )
    (found,), _ = pods.replicas_from_pods([crashed], target_spec(port="http"))
    assert found.restarted == "container triton is not running (CrashLoopBackOff)"


def test_only_an_open_gate_can_be_stale() -> None:
    closed = gated_pod("2026-11-26T15:00:00Z", running("triton", "2026-11-26T15:00:09Z"))
    closed["status"]["conditions"][0]["status"] = "False"
    (found,), _ = pods.replicas_from_pods([closed], target_spec(port="http"))
    assert found.restarted is None
