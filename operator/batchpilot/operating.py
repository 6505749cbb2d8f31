"""`batchpilot operator`: the kopf operator's configuration and its per-policy loop.

Each BatchPolicy gets one kopf daemon running `Controller.follow`: reconcile, write the status
if it changed, post events, then sleep until the next tick, the policy's next scheduled
transition, or a poke — whichever comes first. Pokes come from the watch handlers when the spec
changes or a target Pod appears, disappears, changes IP or readiness. One loop per policy means
one writer per policy: reconciles of the same policy never overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import kopf

from batchpilot import reconciling, telemetry
from batchpilot.api import names
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import backoffs, fleets, pod_repositories
from batchpilot.applying.replicas import Replica
from batchpilot.kube import client, events, policies, secret_credentials
from batchpilot.kube import pods as kube_pods
from batchpilot.policy import governing
from batchpilot.signals import prometheus, sidecars, sources

logger = logging.getLogger("batchpilot.operator")

# A wake-up at a scheduled transition lands just after it, so the decision sees the new state.
TRANSITION_MARGIN_SECONDS = 0.05
# How long a deleted policy's release waits for its loop to stop (kopf cancels it within the
# daemon's cancellation backoff and timeout, 1 s and 10 s).
LOOP_END_TIMEOUT_SECONDS = 15.0
# How long a deleted policy's pass may run on before it is cancelled (kopf's daemons' backoff).
DELETED_PASS_GRACE_SECONDS = 1.0
# Deleted policies remembered so that a loop kopf starts after the DELETED event ends at once.
DELETED_REMEMBERED = 1024


@dataclass(frozen=True)
class Options:
    interval: float = 5.0
    settle_seconds: float = 1.5
    metrics_host: str = "0.0.0.0"  # noqa: S104 - scraped by Prometheus from outside the Pod
    metrics_port: int | None = 9402
    verbose: bool = False
    limits: governing.Limits = field(default_factory=governing.Limits)


def signal_sources(fleet: fleets.TritonFleet) -> reconciling.SignalSourceFactory:
    """Where a policy's signals come from: the sidecars next to its targets (the default),
    the targets' own Triton metrics, or its Prometheus."""

    def build(
        namespace: str, policy: specs.BatchPolicySpec, targets: Sequence[Replica]
    ) -> reconciling.SignalSource:
        source = policy.signal_source
        if source == "prometheus" and policy.load and policy.load.prometheus:
            return prometheus.PrometheusSource(
                policy.load.prometheus.url,
                namespace=namespace,
                pods=[target.name for target in targets],
                models=policy.target.models,
            )
        if source == "triton":
            return sources.TritonMetricsSource(
                [fleet.server(target.http_url) for target in targets],
                models=policy.target.models,
            )
        return sidecars.SidecarSource(
            [target.sidecar_url for target in targets if target.sidecar_url],
            models=policy.target.models,
            slo=policy.slo,
            known_problems=[
                f"pod {target.name}: no container port named "
                f"{policy.target.sidecar_port!r} for the sidecar; left out"
                for target in targets
                if not target.sidecar_url
            ],
        )

    return build


class StatusWriter(Protocol):
    async def write_status(
        self, namespace: str, name: str, known: Mapping[str, Any], wanted: Mapping[str, Any]
    ) -> Mapping[str, Any] | None: ...


class EventPoster(Protocol):
    async def post(
        self,
        involved: Mapping[str, Any],
        *,
        type: events.EventType,  # noqa: A002 - the Event's own field name
        reason: str,
        message: str,
    ) -> None: ...


GovernorEntry = tuple[str, str, dict[str, Any]]
"""A policy in kopf's index of governors: its name, creation time and selector."""


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass
class Controller:
    """Shared by every policy's daemon: the reconciler, the status writer, the pokes."""

    options: Options
    reconciler: reconciling.Reconciler
    policies: StatusWriter
    events: EventPoster
    metrics: telemetry.ControllerMetrics
    clock: Callable[[], datetime.datetime] = utc_now
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    pods_seen: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    loops: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    """Per policy whose loop runs, an event set when it has stopped."""
    passes: dict[tuple[str, str], asyncio.Future[Any]] = field(default_factory=dict)
    """Per policy whose loop runs, its pass in progress: a deleted policy's is cancelled."""
    deleted: dict[str, None] = field(default_factory=dict)
    """The uids of policies whose DELETED event came, oldest first: their loops end. No
    finalizer holds a policy back for kopf to stop its loop (see `handlers`)."""
    governors_index: Mapping[str | None, Iterable[GovernorEntry]] | None = None
    """kopf's index of every policy by namespace (`handlers.governors_by_namespace`), live."""
    pods: kube_pods.Pods | None = None
    """The reader of every policy's Pods, fed by kopf's index of Pods (`attach_pods`)."""
    kube: client.KubeClient | None = None
    """The client of the operator's own requests, closed with it."""

    async def close(self) -> None:
        # A deleted policy's loop is no longer kopf's to stop before its cleanup (no finalizer
        # kept the policy): its pass ends, or is cancelled, before the clients it uses close.
        await self._loops_ended(DELETED_PASS_GRACE_SECONDS)
        for running in list(self.passes.values()):
            running.cancel()
        await self._loops_ended(LOOP_END_TIMEOUT_SECONDS)
        await self.reconciler.fleet.close()
        if self.kube is not None:
            await self.kube.close()

    async def _loops_ended(self, seconds: float) -> None:
        endings = [ended.wait() for ended in self.loops.values()]
        if endings:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await asyncio.gather(*endings)

    def attach_pods(self, index: kube_pods.PodIndex) -> None:
        """Hand kopf's live index of Pods to the reader; kopf fills it before any handler."""
        if self.pods is not None:
            self.pods.index = index

    def governors(self, namespace: str) -> list[governing.Governor]:
        """Every policy of the namespace, for deciding which one governs a Pod."""
        entries = (self.governors_index or {}).get(namespace) or ()
        return [
            governing.Governor(name=name, created=created, selector=selector)
            for name, created, selector in entries
        ]

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    def poke(self, namespace: str, name: str) -> None:
        self.wakeup(namespace, name).set()

    async def follow(
        self,
        *,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        stopped: kopf.DaemonStopped,
        governors: Mapping[str | None, Iterable[GovernorEntry]] | None = None,
    ) -> None:
        """Reconcile one policy until it is deleted or the operator stops; `governors`: kopf's
        live index of every policy, for deciding which one governs a Pod several select."""
        if governors is not None:
            self.governors_index = governors
        state = reconciling.PolicyMemory()
        failing = backoffs.Backoff()
        wakeup = self.wakeup(namespace, name)
        # The status this loop wrote last. kopf's body catches up only when the watch delivers
        # the write, and a pass poked at once (a Pod turning Ready at the end of a rollout)
        # would otherwise start from the status before it and write that back.
        written: Mapping[str, Any] | None = None
        uid = str((body.get("metadata") or {}).get("uid") or "")
        ended = self.loops[(namespace, name)] = asyncio.Event()
        try:
            while not stopped and uid not in self.deleted:
                wakeup.clear()
                known = written if written is not None else (body.get("status") or {})
                current = self.passes[(namespace, name)] = asyncio.ensure_future(
                    self._once(namespace, name, body, known, state, failing)
                )
                try:
                    delay, written = await current
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if current.cancelled() and task is not None and not task.cancelling():
                        break  # the policy was deleted mid-pass (policy_deleted)
                    raise
                sleeper = asyncio.ensure_future(wakeup.wait())
                waiter = asyncio.ensure_future(stopped.wait())
                await asyncio.wait(
                    {sleeper, waiter}, timeout=delay, return_when=asyncio.FIRST_COMPLETED
                )
                for task in (sleeper, waiter):
                    task.cancel()
        finally:
            self.wakeups.pop((namespace, name), None)
            await self.reconciler.forget_policy(namespace, name)
            await state.close_source()
            if self.loops.get((namespace, name)) is ended:
                del self.loops[(namespace, name)]
                self.passes.pop((namespace, name), None)
            self.deleted.pop(uid, None)
            ended.set()

    async def policy_deleted(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], uid: str | None = None
    ) -> None:
        """End the policy's loop (a rollout it was running is cancelled with it); once it has
        stopped, open every gate it left False: no later pass will."""
        if uid is not None:
            self.deleted[uid] = None
            while len(self.deleted) > DELETED_REMEMBERED:
                del self.deleted[next(iter(self.deleted))]
            if (namespace, name) in self.wakeups:  # a loop waits: wake it to see the deletion
                self.poke(namespace, name)
        ended = self.loops.get((namespace, name))
        if ended is not None and uid is not None:
            # A rollout in progress is cancelled, as kopf cancels a stopped daemon: the gates it
            # closed are opened below.
            try:
                async with asyncio.timeout(DELETED_PASS_GRACE_SECONDS):
                    await ended.wait()
            except TimeoutError:
                running = self.passes.get((namespace, name))
                if running is not None:
                    running.cancel()
        if ended is not None:
            try:
                async with asyncio.timeout(LOOP_END_TIMEOUT_SECONDS):
                    await ended.wait()
            except TimeoutError:
                logger.warning("%s/%s: deleted, its loop still running", namespace, name)
        opened = await self.reconciler.release_pods(namespace, spec, name=name)
        if opened:
            logger.info(
                "%s/%s: deleted; readiness gates opened on %s", namespace, name, ", ".join(opened)
            )
        # A Pod it governed may pass to another policy that selects it too: no need to wait.
        for other_namespace, other in list(self.wakeups):
            if other_namespace == namespace and other != name:
                self.poke(namespace, other)

    async def _once(
        self,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        status: Mapping[str, Any],
        state: reconciling.PolicyMemory,
        failing: backoffs.Backoff,
    ) -> tuple[float, Mapping[str, Any] | None]:
        """One reconcile from the policy's latest known status; the seconds until the next, and
        the status as this pass left it (None if unknown: its write failed)."""
        known: Mapping[str, Any] | None = status

        async def progress(interim: dict[str, Any]) -> None:
            nonlocal known
            known = await self.policies.write_status(namespace, name, known or {}, interim)

        try:
            outcome = await self.reconciler.reconcile(
                namespace=namespace,
                name=name,
                spec=dict(body.get("spec") or {}),
                status=dict(status),
                generation=(body.get("metadata") or {}).get("generation"),
                state=state,
                progress=progress,
            )
        except Exception:
            # A bug or an API outage must not end the policy's loop: report, back off, retry.
            delay = failing.failed(time.monotonic())
            logger.exception("%s/%s: reconcile failed; retrying in %gs", namespace, name, delay)
            return delay, known
        failing.succeeded()
        for event in outcome.events:
            if event.reason in ("ProfileSwitched", "DryRunDecision"):
                logger.info("%s/%s: %s", namespace, name, event.message)
            await self.events.post(
                body, type=event.type, reason=event.reason, message=event.message
            )
        # After a failed interim write, the whole status is written (kopf's copy is behind).
        left = await self.policies.write_status(namespace, name, known or {}, outcome.status)
        await self._open_ungoverned(namespace)
        delay = self.options.interval
        if outcome.wake_at is not None:
            until = (outcome.wake_at - self.clock()).total_seconds()
            delay = min(delay, max(until + TRANSITION_MARGIN_SECONDS, 0.0))
        return delay, left

    async def _open_ungoverned(self, namespace: str) -> None:
        """Gates left closed on Pods no policy of the namespace selects any more: each pass of
        any policy there opens them, since no pass of their own will."""
        if self.pods is None or self.governors_index is None:
            return  # without every policy's selector, no Pod is known to be ungoverned
        selectors = [governor.selector for governor in self.governors(namespace)]
        try:
            opened = await self.pods.open_ungoverned(namespace, selectors)
        except client.KubeError as error:
            logger.warning("%s: opening the gates of ungoverned Pods failed: %s", namespace, error)
            return
        if opened:
            logger.info(
                "%s: readiness gates opened on %s (no policy selects them)",
                namespace,
                ", ".join(opened),
            )

    def pod_changed(
        self,
        *,
        namespace: str,
        pod: Mapping[str, Any],
        event_type: str | None,
        index: kopf.Index[str | None, tuple[str, dict[str, Any]]],
    ) -> None:
        """Poke the policies that select a Pod whose address, readiness or containers changed."""
        metadata = pod.get("metadata", {})
        uid = metadata.get("uid", "")
        status = pod.get("status", {})
        ready = [
            c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"
        ]
        # A container's restart matters before its Pod's Ready changes: the gate it made stale
        # must close before Triton answers the kubelet's probe again.
        containers = tuple(
            (c.get("name"), c.get("restartCount"), "running" in (c.get("state") or {}))
            for c in status.get("containerStatuses") or []
        )
        fingerprint = (
            status.get("podIP"),
            status.get("phase"),
            tuple(ready),
            metadata.get("deletionTimestamp"),
            containers,
        )
        if event_type == "DELETED":
            self.pods_seen.pop(uid, None)
        elif self.pods_seen.get(uid) == fingerprint:
            return
        else:
            if uid not in self.pods_seen and self.pods is not None:
                self.pods.governed_pod_appeared(namespace)
            self.pods_seen[uid] = fingerprint
        labels = metadata.get("labels") or {}
        for policy, selector in index.get(namespace, []):
            if governing.selects(selector, labels):
                self.poke(namespace, policy)

    async def open_if_ungoverned(
        self,
        *,
        namespace: str,
        pod: Mapping[str, Any],
        index: kopf.Index[str | None, tuple[str, dict[str, Any]]],
    ) -> None:
        """A Pod whose gate batchpilot holds False and that no policy of its namespace selects:
        its policy was deleted while no operator ran (no finalizer waits for one, see
        `handlers`). Seen when the operator lists the Pods as it starts, or when the Pod
        changes: open its gate."""
        selectors = [selector for _, selector in index.get(namespace, [])]
        if self.pods is None or not kube_pods.closed_and_ungoverned([pod], selectors):
            return
        name = pod["metadata"]["name"]
        try:
            await self.pods.open_gate_of_ungoverned(namespace, name, kube_pods.NO_POLICY_SELECTS)
        except client.KubeError as error:
            logger.warning("%s/%s: opening the gate failed: %s", namespace, name, error)
            return
        logger.info("%s/%s: readiness gate opened (no policy selects it)", namespace, name)

    async def pod_left(self, *, namespace: str, pod: Mapping[str, Any]) -> None:
        """A Pod left the watch. If it was relabelled out of it (names.GOVERNED_LABEL taken off)
        while batchpilot held its gate False, nothing would ever see it again to open the gate:
        open it now. A deleted Pod still carries its labels, and is left alone."""
        name = (pod.get("metadata") or {}).get("name")
        if name is None or not kube_pods.left_closed(pod) or self.pods is None:
            return
        try:
            await self.pods.open_gate_of_ungoverned(
                namespace, name, f"the Pod no longer carries {names.GOVERNED_SELECTOR}"
            )
        except client.KubeError as error:
            logger.warning(
                "%s/%s: opening the gate of a Pod that left failed: %s", namespace, name, error
            )
            return
        logger.info(
            "%s/%s: readiness gate opened (label %s taken off)",
            namespace,
            name,
            names.GOVERNED_LABEL,
        )


def pod_snapshot(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A Pod as the index of Pods keeps it."""
    return kube_pods.snapshot(pod)


def triton_fleet() -> fleets.TritonFleet:
    """The fleet every policy shares. Only the Pod sees its model repository, so LLM models'
    engine arguments are read from the sidecar beside each Triton."""
    return fleets.TritonFleet(engine_arguments=pod_repositories.SidecarEngineArguments())


def build_controller(options: Options) -> Controller:
    kube = client.KubeClient()
    fleet = triton_fleet()
    metrics = telemetry.controller_metrics()
    pods = kube_pods.Pods(kube)
    reconciler = reconciling.Reconciler(
        replicas=pods,
        gates=pods,
        fleet=fleet,
        signal_source=signal_sources(fleet),
        metrics=metrics,
        settle_seconds=options.settle_seconds,
        credential_source=secret_credentials.SecretCredentials(kube),
        limits=options.limits,
        not_injected=pods,
    )
    controller = Controller(
        options=options,
        reconciler=reconciler,
        policies=policies.Policies(kube),
        events=events.Events(kube),
        metrics=metrics,
        pods=pods,
        kube=kube,
    )
    reconciler.governors = controller.governors
    return controller
