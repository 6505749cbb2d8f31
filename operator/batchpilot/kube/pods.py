"""Triton Pods as the operator sees them: replicas, endpoints and the readiness gate.

A policy's replicas are the Pods that match its selector, run, and have an IP. A replica's
Triton endpoint is the Pod IP and `spec.target.port` (a number, or the name of a container
port); the sidecar's is found the same way. A Pod opts into hitless switching with the
readiness gate `batchpilot.dev/config-applied`: while batchpilot holds that condition False the
Pod is not Ready, so Services stop sending it requests.

An open gate vouches for the configuration batchpilot applied. When the container serving
Triton restarts after that (a crash, an OOM kill), Triton comes back with its repository's
configuration, and the kubelet would make the Pod Ready again as soon as Triton answers its
probe. The container's start time, later than the gate's last transition, says so: the rollout
closes such a gate first and opens it once the profile is back.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Mapping
from typing import Any

import kubernetes.client

from batchpilot.applying.replicas import Replica
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


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind:
            found: Mapping[str, Any] = condition
            return found
    return None


def _status_of(condition: Mapping[str, Any] | None) -> str | None:
    return None if condition is None else str(condition.get("status"))


def _timestamp(text: object) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        return None


def _container_serving(pod: Mapping[str, Any], port: int) -> str | None:
    for container in pod["spec"].get("containers", []):
        if any(p.get("containerPort") == port for p in container.get("ports") or []):
            return str(container.get("name"))
    return None


def restarted_since_gate(pod: Mapping[str, Any], port: int) -> str | None:
    """Why the Pod's open gate is stale, or None: the container that serves `port` started
    after the gate last turned True, or is not running at all. Both times have whole seconds,
    so a restart within the second the gate opened is left to the next pass's drift check."""
    gate = _condition(pod, GATE)
    if gate is None or gate.get("status") != "True":
        return None
    opened = _timestamp(gate.get("lastTransitionTime"))
    container = _container_serving(pod, port)
    if opened is None or container is None:
        return None
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status.get("name") != container:
            continue
        state = status.get("state") or {}
        running = state.get("running")
        if running is None:
            stopped = state.get("waiting") or state.get("terminated") or {}
            return f"container {container} is not running ({stopped.get('reason') or 'stopped'})"
        started = _timestamp(running.get("startedAt"))
        if started is not None and started > opened:
            return f"container {container} restarted at {running['startedAt']}"
    return None


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
                gate=_status_of(_condition(pod, GATE)),
                kind="pod",
                labels=tuple(sorted((metadata.get("labels") or {}).items())),
                restarted=restarted_since_gate(pod, http_port) if GATE in gates else None,
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
