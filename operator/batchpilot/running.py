"""The standalone runner: one policy, a list of Triton servers, no Kubernetes.

Every tick it reads load signals, asks the decision engine, and makes each server run the
decided profile, one server after another. Applying is idempotent, so the same pass that rolls
out a switch also repairs drift: a server that restarted with its repository configuration is
brought back to the active profile on the next tick. A server that fails to answer is retried
with exponential backoff and does not hold up the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from batchpilot import telemetry
from batchpilot.applying import actuators, overrides
from batchpilot.policy import decisions, specs
from batchpilot.signals import sidecars, sources
from batchpilot_triton import servers

logger = logging.getLogger("batchpilot.runner")

ServerState = Literal["updated", "failed", "unreachable"]
MAX_BACKOFF_SECONDS = 60.0


@dataclass(frozen=True)
class ServerOutcome:
    url: str
    state: ServerState
    message: str = ""
    reloads: int = 0


@dataclass(frozen=True)
class TickReport:
    at: datetime.datetime
    decision: decisions.Decision
    reading: sources.Reading
    outcomes: tuple[ServerOutcome, ...]


@dataclass
class _Backoff:
    failures: int = 0
    retry_at: float = 0.0

    def failed(self, now: float) -> float:
        self.failures += 1
        delay = min(2.0 ** (self.failures - 1), MAX_BACKOFF_SECONDS)
        self.retry_at = now + delay
        return delay


@dataclass
class _ServerMemory:
    backoff: _Backoff = field(default_factory=_Backoff)
    last_problem: str = ""


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Runner:
    """Drives a set of Triton servers from one policy."""

    def __init__(
        self,
        *,
        name: str,
        spec: specs.BatchPolicySpec,
        triton_servers: Sequence[servers.TritonServer],
        source: sources.SignalSource,
        metrics: telemetry.ControllerMetrics,
        clock: Callable[[], datetime.datetime] = utc_now,
    ) -> None:
        self.name = name
        self.spec = spec
        self.servers = list(triton_servers)
        self.source = source
        self.metrics = metrics
        self.clock = clock
        self.memory = decisions.Memory()
        telemetry.count_from_zero(
            metrics, name, profiles=spec.profiles, reasons=telemetry.RUNNER_APPLY_ERRORS
        )
        self._server_memory = {server.url: _ServerMemory() for server in self.servers}

    async def tick(self) -> TickReport:
        now = self.clock()
        reading = await self.source.read()
        for problem in reading.problems:
            logger.warning("signals: %s", problem)
        decision = decisions.decide(self.spec, now, reading.signals, self.memory)
        self.memory = decision.memory
        self._report_decision(decision, reading)
        if self.spec.dry_run:
            outcomes: list[ServerOutcome] = []
        else:
            outcomes = [await self._apply(server, decision) for server in self.servers]
        for state in ("updated", "failed", "unreachable"):
            count = sum(outcome.state == state for outcome in outcomes)
            self.metrics.targets.labels(self.name, state).set(count)
        return TickReport(now, decision, reading, tuple(outcomes))

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

    def _report_decision(self, decision: decisions.Decision, reading: sources.Reading) -> None:
        if decision.switched:
            logger.info("switch to %s: %s", decision.profile, decision.reason)
            self.metrics.switches.labels(self.name, decision.profile).inc()
        else:
            logger.info("keep %s: %s", decision.profile, decision.reason)
        self.metrics.decisions.labels(self.name, decision.source).inc()
        for profile in self.spec.profiles:
            self.metrics.active_profile.labels(self.name, profile).set(
                1 if profile == decision.profile else 0
            )
        delay = decision.settings.dynamic_batching["max_queue_delay_microseconds"]
        self.metrics.queue_delay.labels(self.name).set(delay)
        upcoming = decision.next_transition
        self.metrics.next_transition.labels(self.name).set(upcoming.timestamp() if upcoming else 0)
        for metric, value in reading.signals.metrics.items():
            self.metrics.signal.labels(self.name, metric).set(value)
        rules = self.spec.load.rules if self.spec.load else []
        missing = any(rule.metric not in reading.signals.metrics for rule in rules)
        self.metrics.signals_unavailable.labels(self.name).set(bool(reading.problems) or missing)
        telemetry.set_objective(self.metrics, self.name, self.spec, decision.profile)
        telemetry.set_roles(self.metrics, self.name, self.spec)

    async def _apply(
        self, server: servers.TritonServer, decision: decisions.Decision
    ) -> ServerOutcome:
        memory = self._server_memory[server.url]
        if time.monotonic() < memory.backoff.retry_at:
            return ServerOutcome(server.url, "unreachable", memory.last_problem)
        try:
            outcome = await self._apply_models(server, decision)
        except servers.Unreachable as error:
            delay = memory.backoff.failed(time.monotonic())
            self._problem(memory, f"{error}; retrying in {delay:g}s", "unreachable")
            return ServerOutcome(server.url, "unreachable", str(error))
        except servers.ExplicitModeRequired as error:
            self._problem(memory, str(error), "explicit_mode_required")
            return ServerOutcome(server.url, "failed", str(error))
        except servers.TritonError as error:
            self._problem(memory, str(error), "model_unavailable")
            return ServerOutcome(server.url, "failed", str(error))
        memory.backoff = _Backoff()
        if outcome.state == "updated":
            memory.last_problem = ""
        return outcome

    async def _apply_models(
        self, server: servers.TritonServer, decision: decisions.Decision
    ) -> ServerOutcome:
        models = self.spec.target.models or await server.loaded_models()
        reloads = 0
        failures: list[str] = []
        for model in models:
            try:
                applied = await actuators.apply_profile(
                    server,
                    model,
                    decision.settings,
                    profile=decision.profile,
                    unload_first=self.spec.rollout.unload_before_load,
                    verify_timeout=self.spec.rollout.verify_timeout_seconds,
                )
            except overrides.ProfileRefused as error:
                failures.append(f"{model}: {error}")
                self._problem(self._server_memory[server.url], f"{server.url}: {error}", "refused")
                continue
            except actuators.ApplyFailed as error:
                failures.append(f"{model}: {error.message}")
                reason = "rejected" if error.rolled_back else "rollback_failed"
                self._problem(self._server_memory[server.url], str(error), reason, repeat=True)
                continue
            if applied.reloaded:
                reloads += 1
                self.metrics.apply_seconds.labels(self.name).observe(applied.seconds)
                logger.info(
                    "applied %s to %s on %s in %.2fs (was %s)",
                    applied.profile,
                    model,
                    server.url,
                    applied.seconds,
                    applied.previous_profile or "the repository configuration",
                )
        if failures:
            return ServerOutcome(server.url, "failed", "; ".join(failures), reloads)
        return ServerOutcome(server.url, "updated", "", reloads)

    def _problem(
        self, memory: _ServerMemory, message: str, reason: str, *, repeat: bool = False
    ) -> None:
        """Count every failure, but log a persistent one once rather than every tick."""
        self.metrics.apply_errors.labels(self.name, reason).inc()
        if repeat or message != memory.last_problem:
            logger.error("%s", message)
        memory.last_problem = message


async def run_standalone(
    *,
    name: str,
    spec: specs.BatchPolicySpec,
    triton_urls: Sequence[str],
    metrics_urls: Sequence[str],
    interval: float,
    listen: tuple[str, int] | None,
    sidecar_urls: Sequence[str] = (),
    ticks: int | None = None,
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
    if sidecar_urls and (spec.load is None or spec.load.source == "sidecar"):
        source = sidecars.SidecarSource(sidecar_urls, models=spec.target.models, slo=spec.slo)
        signals_from = f"sidecars {', '.join(sidecar_urls)}"
    else:
        if sidecar_urls:
            logger.warning("spec.load.source is not sidecar: the sidecars given are not read")
        source = sources.TritonMetricsSource(triton_servers, models=spec.target.models)
        signals_from = "Triton metrics"
    runner = Runner(
        name=name, spec=spec, triton_servers=triton_servers, source=source, metrics=metrics
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
        name,
        ", ".join(server.url for server in triton_servers),
        signals_from,
        interval,
    )
    try:
        await runner.run(interval=interval, stop=stop, on_tick=count)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await source.close()
        for server in triton_servers:
            await server.close()
        if exporter is not None:
            await exporter.cleanup()
    logger.info("stopped")
    return 0
