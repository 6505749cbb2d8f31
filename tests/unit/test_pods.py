"""Replicas from the API's Pods: endpoints, named ports, the readiness gate."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying.replicas import ServingContainer
from batchpilot.kube import client, pods


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


def test_the_index_keeps_what_batchpilot_reads_of_a_pod_and_drops_the_rest() -> None:
    full = triton_and_sidecar(
        {"name": "triton", "containerID": "containerd://t1", "state": {"running": {}},
         "image": "triton:24.08", "lastState": {}},
    )  # fmt: skip
    full["metadata"].update(labels={"app": "triton"}, managedFields=[{"manager": "kubelet"}])
    full["spec"]["containers"][0].update(image="triton:24.08", env=[{"name": "A", "value": "b"}])
    full["spec"]["volumes"] = [{"name": "models", "emptyDir": {}}]
    full["spec"]["nodeName"] = "node-a"
    full["status"]["hostIP"] = "10.0.0.1"
    kept = pods.snapshot(full)
    assert kept["metadata"] == {"name": "g", "uid": "uid-g", "labels": {"app": "triton"}}
    assert kept["spec"]["containers"][0] == {
        "name": "triton",
        "ports": full["spec"]["containers"][0]["ports"],
    }
    assert "volumes" not in kept["spec"]
    assert "hostIP" not in kept["status"]
    # Everything a replica is made of survives the trim, its node (what its reloads share) too.
    assert pods.replicas_from_pods([kept], target_spec(port="http"))[0][0].host == "node-a"
    assert pods.replicas_from_pods([kept], target_spec(port="http")) == pods.replicas_from_pods(
        [full], target_spec(port="http")
    )


def labelled(name: str, **labels: str) -> dict[str, Any]:
    return pods.snapshot(pod(name, metadata={"labels": labels}))


def test_a_policy_s_replicas_are_the_indexed_pods_of_its_namespace_its_selector_matches() -> None:
    reader = pods.Pods(client.KubeClient())
    reader.index = {
        "desk": [
            labelled("a", app="triton", zone="a"),
            labelled("b", app="triton", zone="c"),
            labelled("c", app="triton", zone="b", canary="yes"),
            labelled("web", app="web", zone="a"),
        ],
        "other": [labelled("elsewhere", app="triton", zone="a")],
    }
    target = specs.Target.model_validate(
        {
            "selector": {
                "matchLabels": {"app": "triton"},
                "matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["a", "b"]},
                    {"key": "canary", "operator": "DoesNotExist"},
                ],
            }
        }
    )
    found, _ = asyncio.run(reader.replicas("desk", target))
    assert [replica.name for replica in found] == ["a"]
    assert asyncio.run(reader.replicas("empty", target)) == ([], [])


def test_without_the_index_a_pass_fails_instead_of_finding_no_replicas() -> None:
    with pytest.raises(RuntimeError, match="index is not filled"):
        asyncio.run(pods.Pods(client.KubeClient()).replicas("desk", target_spec()))


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


@pytest.mark.looptime
async def test_wait_ready_returns_once_the_watch_shows_each_pod_ready() -> None:
    loop = asyncio.get_running_loop()
    reader = pods.Pods(client.KubeClient(), clock=loop.time)
    index: dict[str | None, list[dict[str, Any]]] = {
        "ns": [pod("triton-0", conditions=[{"type": "Ready", "status": "False"}])]
    }
    reader.index = index

    async def kubelet_makes_it_ready() -> None:
        await asyncio.sleep(3)
        index["ns"][0]["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    started = loop.time()
    _, late = await asyncio.gather(
        kubelet_makes_it_ready(), reader.wait_ready("ns", ["triton-0"], within=30)
    )
    assert late == []
    assert 3 <= loop.time() - started < 3 + 2 * pods.READY_POLL_SECONDS


@pytest.mark.looptime
async def test_wait_ready_names_the_pods_not_ready_at_its_timeout_and_those_gone() -> None:
    loop = asyncio.get_running_loop()
    reader = pods.Pods(client.KubeClient(), clock=loop.time)
    deleting = pod("triton-2", metadata={"deletionTimestamp": "2026-11-29T00:00:00Z"})
    reader.index = {
        "ns": [
            pod("triton-0", conditions=[{"type": "Ready", "status": "True"}]),
            pod("triton-1", conditions=[{"type": "Ready", "status": "False"}]),
            deleting,
        ]
    }
    started = loop.time()
    late = await reader.wait_ready(
        "ns", ["triton-0", "triton-1", "triton-2", "triton-9"], within=30
    )
    assert late == ["triton-1", "triton-2", "triton-9"]
    assert loop.time() - started == pytest.approx(30, abs=2 * pods.READY_POLL_SECONDS)
