"""Triton Pods as the operator sees them: replicas, endpoints and the readiness gate.

A policy's replicas are the Pods that match its selector, run, and have an IP. A replica's
Triton endpoint is the Pod IP and `spec.target.port` (a number, or the name of a container
port); the sidecar's is found the same way. A Pod opts into hitless switching with the
readiness gate `batchpilot.dev/config-applied`: while batchpilot holds that condition False the
Pod is not Ready, so Services stop sending it requests.

Each replica also carries which run of the container serving Triton its Pod reports (the
runtime's container ID): when that changes while the gate is open, Triton restarted with its
repository's configuration (see `rollouts.mark_restarted`).
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Mapping
from typing import Any

import kubernetes.client

from batchpilot.applying.replicas import Replica, ServingContainer
from batchpilot.policy import specs

GATE = "batchpilot.dev/config-applied"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"


def selector_string(selector: specs.LabelSelector) -> str:
    """A label selector in the API's query syntax."""
    terms = [f"{key}={value}" for key, value in sorted(selector.match_labels.items())]
    for requirement in selector.match_expressions:
        values = ",".join(requirement.values)
        terms.append(
            {
                "In": f"{requirement.key} in ({values})",
                "NotIn": f"{requirement.key} notin ({values})",
                "Exists": requirement.key,
                "DoesNotExist": f"!{requirement.key}",
            }[requirement.operator]
        )
    return ",".join(terms)


def _port(pod: Mapping[str, Any], reference: int | str | None) -> int | None:
    if reference is None or isinstance(reference, int):
        return reference
    if reference.isascii() and reference.isdigit():
        return int(reference)
    for container in pod["spec"].get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == reference:
                return int(port["containerPort"])
    return None


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _condition(pod: Mapping[str, Any], kind: str) -> str | None:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind:
            return str(condition.get("status"))
    return None


def serving_container(pod: Mapping[str, Any], port: int) -> ServingContainer | None:
    """The container that declares `port`, and which run of it the Pod reports."""
    name = next(
        (
            container.get("name")
            for container in pod["spec"].get("containers", [])
            if any(p.get("containerPort") == port for p in container.get("ports") or [])
        ),
        None,
    )
    status = next(
        (s for s in pod.get("status", {}).get("containerStatuses") or [] if s.get("name") == name),
        None,
    )
    if name is None or status is None:
        return None
    state = status.get("state") or {}
    running = state.get("running")
    if running is None:
        stopped = state.get("waiting") or state.get("terminated") or {}
        return ServingContainer(name=name, run="", stopped=str(stopped.get("reason") or "stopped"))
    run = status.get("containerID") or f"{status.get('restartCount')}@{running.get('startedAt')}"
    return ServingContainer(name=name, run=str(run))


def replicas_from_pods(
    pods: list[Mapping[str, Any]], target: specs.Target
) -> tuple[list[Replica], list[str]]:
    """The Pods that can be replicas, and a note for each that cannot (e.g. no such port)."""
    found: list[Replica] = []
    skipped: list[str] = []
    for pod in pods:
        metadata, status = pod["metadata"], pod.get("status", {})
        name = metadata["name"]
        if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        if not status.get("podIP"):
            continue
        http_port = _port(pod, target.port)
        if http_port is None:
            skipped.append(f"{name}: no container port named {target.port!r}")
            continue
        gates = {gate.get("conditionType") for gate in pod["spec"].get("readinessGates") or []}
        ip = status["podIP"]
        sidecar_port = _port(pod, target.sidecar_port)
        found.append(
            Replica(
                name=name,
                http_url=f"http://{_host(ip)}:{http_port}",
                sidecar_url=f"http://{_host(ip)}:{sidecar_port}" if sidecar_port else None,
                gated=GATE in gates,
                gate=_condition(pod, GATE),
                kind="pod",
                labels=tuple(sorted((metadata.get("labels") or {}).items())),
                serving=serving_container(pod, http_port),
            )
        )
    return sorted(found, key=lambda t: t.name), skipped


class Pods:
    """Reads a policy's Pods and writes their gate condition, through the Kubernetes API."""

    def __init__(self, api: kubernetes.client.ApiClient, *, timeout: float = 10.0) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self._timeout = timeout

    async def replicas(
        self, namespace: str, target: specs.Target
    ) -> tuple[list[Replica], list[str]]:
        # Raw JSON: the Pods are read as the API writes them, not as the client's models.
        response: Any = await asyncio.to_thread(
            self._core.list_namespaced_pod,
            namespace,
            label_selector=selector_string(target.selector),
            _preload_content=False,
            _request_timeout=self._timeout,
        )
        pods = json.loads(response.data)["items"]
        return replicas_from_pods(pods, target)

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        """Set the config-applied condition; the kubelet derives the Pod's Ready from it."""
        condition = {
            "type": GATE,
            "status": "True" if applied else "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": datetime.datetime.now(datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"
            ),
        }
        await asyncio.to_thread(
            self._core.patch_namespaced_pod_status,
            pod,
            namespace,
            {"status": {"conditions": [condition]}},
            _content_type=STRATEGIC_MERGE,
            _request_timeout=self._timeout,
        )
