"""Triton Pods as the operator sees them: replicas, endpoints and the readiness gate.

A policy's replicas are the Pods that match its selector, run, and have an IP. A replica's
Triton endpoint is the Pod IP and `spec.target.port` (a number, or the name of a container
port); the sidecar's is found the same way. A Pod opts into hitless switching with the
readiness gate `batchpilot.dev/config-applied`: while batchpilot holds that condition False the
Pod is not Ready, so Services stop sending it requests.

Each replica also carries which run of the container serving Triton its Pod reports (the
runtime's container ID): when that changes while the gate is open, Triton restarted with its
repository's configuration (see `rollouts.mark_restarted`).

A Pod opts in with the label `batchpilot.dev/governed: "true"` (`names.GOVERNED_LABEL`): the
operator's watch of Pods carries it as a server-side label selector, so a cluster's other Pods
never reach the operator, and a policy's selector picks among the Pods that opted in.

The Pods are read from memory, not from the API: kopf watches every opted-in Pod of the
namespaces the operator serves and keeps a trimmed copy of each in an index
(`handlers.pods_by_namespace`, filled before any policy's loop starts), so a pass costs no
request however many policies there are. Only the gate is written through the API.

One kind of Pod the watch cannot see: one whose template opted into the admission webhook
(`names.INJECT_LABEL`) but that was created while the webhook did not answer (no operator ran,
or it timed out: `failurePolicy: Ignore` admits it as written). It has no governed label, no
sidecar and no gate, serves its repository's configuration, and nothing batchpilot does reaches
it. `Pods.not_injected` finds such Pods with one small LIST per namespace (a label selector
that matches only them, normally nothing), at most every NOT_INJECTED_EVERY_SECONDS and again
soon after a governed Pod appears there (a replacement), so the policy's status can say so.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchpilot.api import names
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying.replicas import Replica, ServingContainer
from batchpilot.kube.client import KubeClient, KubeError, namespaced
from batchpilot.policy import governing

logger = logging.getLogger("batchpilot.operator")

GATE = names.CONFIG_APPLIED_GATE
NO_POLICY_SELECTS = "no batchpilot policy selects this Pod any more"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"

NOT_INJECTED_SELECTOR = f"{names.INJECT_SELECTOR},{names.GOVERNED_LABEL}!={names.GOVERNED_VALUE}"
"""The Pods that opted into the webhook and did not get its injection."""
NOT_INJECTED_EVERY_SECONDS = 60.0
"""How old a namespace's list of them may grow before a pass lists again."""
NOT_INJECTED_AT_MOST_EVERY_SECONDS = 5.0
"""However often governed Pods appear, one LIST per namespace in this time at most."""
NOT_INJECTED_LISTED = 50
"""The most such Pods a LIST asks for (a page); where the API server had more, "more" says so."""
NOT_INJECTED_NAMED = 10
"""The most of them a status names."""
READY_POLL_SECONDS = 0.2
"""How often `wait_ready` looks at the index (memory, not the API)."""


PodIndex = Mapping[str | None, Iterable[Mapping[str, Any]]]
"""Every Pod the operator watches, by namespace, as `snapshot` keeps it (kopf's live index)."""


def snapshot(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What batchpilot reads of a Pod, and nothing else: the index holds thousands of them."""
    metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    return {
        "metadata": {
            key: metadata[key]
            for key in ("name", "uid", "labels", "deletionTimestamp")
            if metadata.get(key) is not None
        },
        "spec": {
            "containers": [
                {"name": container.get("name"), "ports": container.get("ports") or []}
                for container in spec.get("containers") or []
            ],
            "readinessGates": spec.get("readinessGates") or [],
            **({"nodeName": spec["nodeName"]} if spec.get("nodeName") else {}),
        },
        "status": {
            key: status[key]
            for key in ("phase", "podIP", "conditions", "containerStatuses")
            if status.get(key) is not None
        },
    }


def selected(pods: Iterable[Mapping[str, Any]], selector: specs.LabelSelector) -> list[Any]:
    """The Pods whose labels the selector matches, as the API's label selection would."""
    wanted = selector.model_dump(by_alias=True)
    return [
        pod
        for pod in pods
        if governing.selects(wanted, (pod.get("metadata") or {}).get("labels") or {})
    ]


def closed_and_ungoverned(
    pods: Iterable[Mapping[str, Any]], selectors: Iterable[Mapping[str, Any]]
) -> list[str]:
    """The Pods whose gate batchpilot holds False and that no policy selects any more (a Pod
    relabelled while its gate was closed): no policy's pass would ever open it again."""
    wanted = list(selectors)
    return sorted(
        pod["metadata"]["name"]
        for pod in pods
        if not pod["metadata"].get("deletionTimestamp")
        and any(g.get("conditionType") == GATE for g in pod["spec"].get("readinessGates") or [])
        and _condition(pod, GATE) == "False"
        and not any(
            governing.selects(selector, pod["metadata"].get("labels") or {}) for selector in wanted
        )
    )


def governed(pod: Mapping[str, Any]) -> bool:
    """The Pod opted in: it carries names.GOVERNED_LABEL with its value, as the watch selects."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(names.GOVERNED_LABEL) == names.GOVERNED_VALUE)


def left_closed(pod: Mapping[str, Any]) -> bool:
    """A Pod that opted out (the label taken off) while batchpilot held its gate False."""
    metadata = pod.get("metadata") or {}
    return (
        not governed(pod)
        and not metadata.get("deletionTimestamp")
        and any(
            g.get("conditionType") == GATE
            for g in (pod.get("spec") or {}).get("readinessGates") or []
        )
        and _condition(pod, GATE) == "False"
    )


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
                node=pod["spec"].get("nodeName"),
            )
        )
    return sorted(found, key=lambda t: t.name), skipped


@dataclass(frozen=True)
class NotInjected:
    """A namespace's Pods that opted into the webhook and were created without its injection,
    as one LIST found them: each name with its labels, and whether there were more."""

    listed_at: float
    pods: tuple[tuple[str, Mapping[str, str]], ...] = ()
    more: bool = False

    def selected_by(self, selector: Mapping[str, Any]) -> list[str]:
        """The names the selector matches, NOT_INJECTED_NAMED at most, then how many more."""
        found = sorted(name for name, labels in self.pods if governing.selects(selector, labels))
        named, rest = found[:NOT_INJECTED_NAMED], len(found) - NOT_INJECTED_NAMED
        if rest > 0:
            return [*named, f"{rest}{'+' if self.more else ''} more"]
        return [*named, "more"] if found and self.more else named


def not_injected_in(answer: Mapping[str, Any], listed_at: float) -> NotInjected:
    """The names and labels of a LIST's Pods, those still running or starting."""
    pods = tuple(
        (str(metadata["name"]), dict(metadata.get("labels") or {}))
        for pod in answer.get("items") or []
        if (metadata := pod.get("metadata") or {}).get("name")
        and not metadata.get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase") in ("Pending", "Running")
    )
    more = bool((answer.get("metadata") or {}).get("continue"))
    return NotInjected(listed_at=listed_at, pods=pods, more=more)


class Pods:
    """Reads a policy's Pods from the watch-fed index and writes their gate condition through
    the Kubernetes API."""

    def __init__(self, client: KubeClient, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self.index: PodIndex | None = None
        """kopf's index of every watched Pod (`handlers.pods_by_namespace`), live; the handlers
        hand it over before the first pass."""
        self._not_injected: dict[str, NotInjected] = {}
        self._stale: set[str] = set()
        self._tried: dict[str, float] = {}
        self._listing: dict[str, asyncio.Lock] = {}

    def governed_pod_appeared(self, namespace: str) -> None:
        """A governed Pod appeared in the namespace: perhaps the replacement of one that was not
        injected, so the next pass lists again (NOT_INJECTED_AT_MOST_EVERY_SECONDS allowing)."""
        self._stale.add(namespace)

    async def not_injected(self, namespace: str, selector: specs.LabelSelector) -> list[str]:
        """The Pods the selector matches that opted into the webhook and were created without
        its injection (see the module's docstring); [] where they cannot be listed now."""
        found = await self._not_injected_listed(namespace)
        return found.selected_by(selector.model_dump(by_alias=True)) if found else []

    async def _not_injected_listed(self, namespace: str) -> NotInjected | None:
        lock = self._listing.setdefault(namespace, asyncio.Lock())
        async with lock:  # the namespace's policies share one LIST
            known = self._not_injected.get(namespace)
            now = self._clock()
            since_tried = now - self._tried.get(namespace, float("-inf"))
            age = float("inf") if known is None else now - known.listed_at
            wanted = age >= NOT_INJECTED_EVERY_SECONDS or namespace in self._stale
            if not wanted or since_tried < NOT_INJECTED_AT_MOST_EVERY_SECONDS:
                return known
            self._tried[namespace] = now
            self._stale.discard(namespace)
            # resourceVersion 0: from the API server's watch cache, never a read of etcd, on
            # every Kubernetes version; the selector matches none but these Pods.
            query = urllib.parse.urlencode(
                {
                    "labelSelector": NOT_INJECTED_SELECTOR,
                    "limit": NOT_INJECTED_LISTED,
                    "resourceVersion": "0",
                }
            )
            try:
                answer = await self._client.request(
                    f"listing the Pods of {namespace} created without injection",
                    "GET",
                    f"{namespaced('v1', namespace, 'pods')}?{query}",
                )
            except KubeError as error:
                logger.warning("%s: %s", namespace, error)
                return known
            listed = self._not_injected[namespace] = not_injected_in(answer, now)
            return listed

    async def replicas(
        self, namespace: str, target: specs.Target
    ) -> tuple[list[Replica], list[str]]:
        if self.index is None:
            raise RuntimeError("the Pod index is not filled yet: no handler has handed it over")
        in_namespace = self.index.get(namespace) or ()
        return replicas_from_pods(selected(in_namespace, target.selector), target)

    async def open_ungoverned(
        self, namespace: str, selectors: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        """Open the gates `closed_and_ungoverned` finds in the namespace; their names."""
        if self.index is None:
            return []
        names = closed_and_ungoverned(self.index.get(namespace) or (), selectors)
        for name in names:
            await self.open_gate_of_ungoverned(namespace, name, NO_POLICY_SELECTS)
        return names

    async def open_gate_of_ungoverned(self, namespace: str, pod: str, why: str) -> None:
        """Open the gate of a Pod batchpilot no longer governs (`why`): it serves what it runs."""
        await self.set_gate(
            namespace,
            pod,
            applied=True,
            reason="NotGoverned",
            message=f"{why}; it serves the configuration it runs",
        )

    async def wait_ready(self, namespace: str, pods: Sequence[str], *, within: float) -> list[str]:
        """Wait, at most `within` seconds, until each Pod is Ready as the watch last saw it;
        the ones that are not by then (a Pod gone or being deleted at once). Read from the
        index, so the wait costs no request: it sees a Pod Ready once the API server has it
        so, and the endpoint controller acts on that same change."""
        deadline = self._clock() + within
        waiting, gone = set(pods), set[str]()
        while True:
            by_name = {
                pod["metadata"]["name"]: pod for pod in (self.index or {}).get(namespace) or ()
            }
            gone |= {
                name
                for name in waiting
                if name not in by_name or by_name[name]["metadata"].get("deletionTimestamp")
            }
            waiting = {
                name for name in waiting - gone if _condition(by_name[name], "Ready") != "True"
            }
            if not waiting or self._clock() >= deadline:
                return sorted(gone | waiting)
            await asyncio.sleep(READY_POLL_SECONDS)

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
        await self._client.request(
            f"setting the gate of Pod {namespace}/{pod}",
            "PATCH",
            namespaced("v1", namespace, "pods", pod, "status"),
            body={"status": {"conditions": [condition]}},
            content_type=STRATEGIC_MERGE,
        )
