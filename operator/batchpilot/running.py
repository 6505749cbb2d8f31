"""The standalone runner: one policy, a list of Triton servers, no Kubernetes.

It drives the operator's engine (`batchpilot.reconciling`) with the servers on its command line
for replicas and no readiness gates: every tick reads load signals, decides, and rolls the
decided profile out over the servers `rollout.maxUnavailable` at a time, exactly as the
operator does. Applying is idempotent, so the same pass that rolls out a switch also repairs
drift: a server that restarted with its repository configuration is brought back to the active
profile on the next tick. A server that fails to answer is left alone with exponential backoff
and does not hold up the others. What the operator posts as events, the runner logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpilot import reconciling, reporting, telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import credentials, engines, fleets, replicas, rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import decisions
from batchpilot.signals import sidecars, sources
from batchpilot_triton import servers

logger = logging.getLogger("batchpilot.runner")


@dataclass(frozen=True)
class TickReport:
    """What one tick found and did."""

    at: datetime.datetime
    decision: decisions.Decision
    reading: sources.Reading
    rollout: rollouts.Result | None
    """None when the spec names a model some server lacks: nothing was applied."""
    events: tuple[reporting.Event, ...]

    @property
    def outcomes(self) -> tuple[rollouts.Outcome, ...]:
        return self.rollout.outcomes if self.rollout else ()


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class _Servers:
    """The runner's replicas: the same servers every tick, whatever the selector says."""

    def __init__(self, found: Sequence[Replica]) -> None:
        self._found = list(found)

    async def replicas(
        self, namespace: str, target: specs.Target
    ) -> tuple[list[Replica], list[str]]:
        return list(self._found), []


def _replicas(
    triton_servers: Sequence[servers.TritonServer], sidecar_urls: Sequence[str]
) -> list[Replica]:
    found = [replicas.from_url(server.url) for server in triton_servers]
    if len(sidecar_urls) != len(found):
        return found
    return [
        dataclasses.replace(replica, sidecar_url=url.rstrip("/"))
        for replica, url in zip(found, sidecar_urls, strict=True)
    ]


class Runner:
    """Drives a set of Triton servers from one policy."""

    def __init__(
        self,
        *,
        name: str,
        spec: specs.BatchPolicySpec,
        triton_servers: Sequence[servers.TritonServer],
        namespace: str = "",
        source: sources.SignalSource,
        metrics: telemetry.ControllerMetrics,
        clock: Callable[[], datetime.datetime] = utc_now,
        model_repository: Path | None = None,
        credential_source: credentials.CredentialSource | None = None,
        sidecar_urls: Sequence[str] = (),
    ) -> None:
        """`sidecar_urls`: the sidecar beside each server, in the servers' order (a canary
        tells the servers' figures apart by them); none, or not one each: unknown."""
        self.name = name
        self.namespace = namespace
        """Only a label of the runner's series (the policy document's metadata.namespace)."""
        self.spec = spec
        self.servers = list(triton_servers)
        self.metrics = metrics
        self.fleet = fleets.TritonFleet(
            engine_arguments=engines.ModelRepository(model_repository)
            if model_repository is not None
            else None
        )
        for server in self.servers:
            self.fleet.adopt(server)
        self.engine = reconciling.Reconciler(
            replicas=_Servers(_replicas(self.servers, sidecar_urls)),
            gates=rollouts.NoGates(),
            fleet=self.fleet,
            signal_source=lambda namespace, policy, found: source,
            metrics=metrics,
            clock=clock,
            settle_seconds=0.0,
            credential_source=credential_source,
        )
        self.state = reconciling.PolicyMemory()
        self.status: dict[str, Any] = {}
        """The status the operator would write for this policy, as of the last tick."""
        telemetry.count_from_zero(
            metrics, telemetry.PolicyLabels(namespace, name), profiles=spec.profiles
        )

    async def tick(self) -> TickReport:
        report = await self.engine.reconcile(
            namespace=self.namespace,
            name=self.name,
            spec=self.spec,
            status=self.status,
            generation=None,
            state=self.state,
        )
        self.status = report.status
        assert report.decision is not None, "a parsed spec is always decided"
        tick = TickReport(report.at, report.decision, report.reading, report.rollout, report.events)
        self._log(tick)
        return tick

    async def run(
        self,
        *,
        interval: float,
        stop: asyncio.Event,
        on_tick: Callable[[TickReport], None] | None = None,
    ) -> None:
        """Tick every `interval` seconds until `stop` is set."""
        while not stop.is_set():
            started = time.monotonic()
            report = await self.tick()
            if on_tick:
                on_tick(report)
            remaining = interval - (time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(remaining, 0.0))

    async def close(self) -> None:
        """Close the signal source and every server's client."""
        await self.state.close_source()
        await self.fleet.close()
        for server in self.servers:
            await server.close()

    def _log(self, report: TickReport) -> None:
        for problem in report.reading.problems:
            logger.warning("signals: %s", problem)
        decision = report.decision
        verb = "switch to" if decision.switched else "keep"
        logger.info("%s %s: %s", verb, decision.profile, decision.reason)
        for event in report.events:
            if event.reason not in ("ProfileSwitched", "DryRunDecision"):
                level = logging.WARNING if event.type == "Warning" else logging.INFO
                logger.log(level, "%s: %s", event.reason, event.message)


async def run_standalone(
    *,
    name: str,
    spec: specs.BatchPolicySpec,
    triton_urls: Sequence[str],
    namespace: str = "",
    metrics_urls: Sequence[str],
    interval: float,
    listen: tuple[str, int] | None,
    sidecar_urls: Sequence[str] = (),
    model_repository: Path | None = None,
    ticks: int | None = None,
    credential_source: credentials.CredentialSource | None = None,
) -> int:
    """`batchpilot run`: tick until SIGTERM or Ctrl-C (or `ticks` ticks), then stop cleanly."""
    if metrics_urls and len(metrics_urls) != len(triton_urls):
        raise ValueError("give one --triton-metrics per --triton, in the same order, or none")
    paired_metrics: Sequence[str | None] = metrics_urls or [None] * len(triton_urls)
    triton_servers = [
        servers.TritonServer(url, metrics_url=metrics_url)
        for url, metrics_url in zip(triton_urls, paired_metrics, strict=True)
    ]
    metrics = telemetry.controller_metrics()
    exporter = (
        await telemetry.serve(metrics.registry, host=listen[0], port=listen[1]) if listen else None
    )
    source: sources.SignalSource
    if sidecar_urls and spec.signal_source == "sidecar":
        source = sidecars.SidecarSource(sidecar_urls, models=spec.target.models, slo=spec.slo)
        signals_from = f"sidecars {', '.join(sidecar_urls)}"
    else:
        if sidecar_urls:
            logger.warning("spec.load.source is not sidecar: the sidecars given are not read")
        source = sources.TritonMetricsSource(triton_servers, models=spec.target.models)
        signals_from = "Triton metrics"
    runner = Runner(
        name=name,
        namespace=namespace,
        spec=spec,
        triton_servers=triton_servers,
        source=source,
        metrics=metrics,
        model_repository=model_repository,
        credential_source=credential_source,
        sidecar_urls=sidecar_urls if spec.signal_source == "sidecar" else (),
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    counted = 0

    def count(_: TickReport) -> None:
        nonlocal counted
        counted += 1
        if ticks is not None and counted >= ticks:
            stop.set()

    logger.info(
        "running policy %s against %s; signals from %s; every %gs",
        telemetry.PolicyLabels(namespace, name),
        ", ".join(server.url for server in triton_servers),
        signals_from,
        interval,
    )
    try:
        await runner.run(interval=interval, stop=stop, on_tick=count)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await runner.close()
        if exporter is not None:
            await exporter.cleanup()
    logger.info("stopped")
    return 0
