"""`batchpilot demo`: a real Triton, the demo model, a policy, load, and switches you can watch.

The demo starts a local tritonserver with `gpu_sim` (a model whose every batch holds one
emulated accelerator for `t0 + c*b^alpha`), writes a policy whose schedule is compressed into the
next minutes, and runs the standalone runner against it while an open-loop load generator goes
through quiet and busy phases:

1. quiet traffic: the `interactive` profile (short queue delay, small batches, low latency);
2. a burst: the load rule holds and switches to `bulk` (long delay, big batches): fewer, larger
   executions, so the device is busy far less for the same traffic;
3. quiet again: the rule lets go and `interactive` returns;
4. a scheduled "backfill" window opens at a minute boundary and switches to `bulk` by the clock.

It prints one line per tick and ends with a table comparing the profiles as measured.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import numpy as np

from batchpilot import running, telemetry
from batchpilot.api import documents, names, v1alpha1
from batchpilot.api.v1alpha1 import specs
from batchpilot.signals import sources
from batchpilot_harness import demo_models, loadgen, local_triton
from batchpilot_triton import scraping, servers

DEMO_MODELS = (demo_models.GPU_SIM, demo_models.TORCH_MLP)
TICK_SECONDS = 1.0
_ROLLING_SECONDS = 2.0


@dataclass(frozen=True)
class Plan:
    """The demo's timeline: load phases and the policy, from the instant it starts."""

    phases: tuple[loadgen.Phase, ...]
    window_opens: datetime.datetime
    policy: dict[str, Any]

    @property
    def seconds(self) -> float:
        return sum(phase.seconds for phase in self.phases)


def plan(*, now: datetime.datetime, short: bool, model: str) -> Plan:
    """Phases and policy such that every switch happens while the demo runs.

    Schedule windows have minute resolution, so the backfill window opens at the first minute
    boundary after the burst has ended, the load rule has let go and the dwell has passed."""
    quiet, burst, tail = (6.0, 12.0, 12.0) if short else (20.0, 30.0, 40.0)
    quiet_rate, burst_rate = 100.0, 600.0
    # The rule holds at half the burst's rate, so that a loaded machine whose client sends only
    # part of the burst still shows the switch (one run in ten beside a build fell short of 400).
    above, below = 300, 200
    hold, dwell = (3, 6) if short else (5, 15)
    settled = now + datetime.timedelta(seconds=quiet + burst + hold + dwell + 8)
    window_opens = settled.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    before_window = (window_opens - now).total_seconds() - quiet - burst
    phases = (
        loadgen.Phase(rate=quiet_rate, seconds=quiet),
        loadgen.Phase(rate=burst_rate, seconds=burst),
        loadgen.Phase(rate=quiet_rate, seconds=before_window + tail),
    )
    window_closes = window_opens + datetime.timedelta(minutes=2)
    policy = {
        "apiVersion": v1alpha1.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "demo"},
        "spec": {
            "target": {"selector": {"matchLabels": {"app": "triton"}}, "models": [model]},
            "profiles": {
                "interactive": {"maxQueueDelayMicroseconds": 500, "preferredBatchSizes": [4, 8]},
                "bulk": {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]},
            },
            "defaultProfile": "interactive",
            "schedule": {
                "timezone": "UTC",
                "windows": [
                    {
                        "profile": "bulk",
                        "start": window_opens.strftime("%H:%M"),
                        "end": window_closes.strftime("%H:%M"),
                    }
                ],
            },
            "load": {
                "rules": [
                    {
                        "profile": "bulk",
                        "metric": "requestRate",
                        "above": above,
                        "below": below,
                        "for": f"{hold}s",
                    }
                ]
            },
            "minDwellSeconds": dwell,
        },
    }
    return Plan(phases=phases, window_opens=window_opens, policy=policy)


@dataclass
class _ProfileTotals:
    seconds: float = 0.0
    inferences: float = 0.0
    executions: float = 0.0
    device_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    failed: int = 0


@dataclass
class _Timeline:
    """Which profile was in force when, in the load generator's clock."""

    switches: list[tuple[float, str, str]] = field(default_factory=list)

    def profile_at(self, offset: float) -> str | None:
        current = None
        for at, profile, _ in self.switches:
            if at > offset:
                break
            current = profile
        return current


class _LiveView:
    def __init__(self, out: TextIO, load_started: float) -> None:
        self.out = out
        self.load_started = load_started
        self.recent: deque[tuple[float, float]] = deque()
        self.timeline = _Timeline()
        self.totals: dict[str, _ProfileTotals] = {}

    def record(self, record: loadgen.RequestRecord) -> None:
        if record.sent is None:
            return
        if record.latency is not None and record.succeeded:
            self.recent.append((record.sent + record.latency, record.latency * 1000))

    def tick(self, report: running.TickReport) -> None:
        offset = time.monotonic() - self.load_started
        decision = report.decision
        if decision.switched:
            self.timeline.switches.append((offset, decision.profile, decision.source))
        while self.recent and self.recent[0][0] < offset - _ROLLING_SECONDS:
            self.recent.popleft()
        rates = [r for per_model in report.reading.per_server.values() for r in per_model.values()]
        self._account(decision.profile, rates)
        self.out.write(self._line(offset, report, rates) + "\n")
        self.out.flush()

    def _account(self, profile: str, rates: Sequence[scraping.ModelRates]) -> None:
        totals = self.totals.setdefault(profile, _ProfileTotals())
        if rates:
            totals.seconds += rates[0].seconds
        totals.inferences += sum(r.counted.inferences for r in rates)
        totals.executions += sum(r.counted.executions for r in rates)
        totals.device_seconds += sum(r.counted.device_busy_seconds for r in rates)

    def _line(
        self, offset: float, report: running.TickReport, rates: Sequence[scraping.ModelRates]
    ) -> str:
        decision = report.decision
        latencies = [latency for _, latency in self.recent]
        p50, p95 = np.percentile(latencies, [50, 95]) if latencies else (math.nan, math.nan)
        request_rate = sum(r.request_rate for r in rates)
        inferences = sum(r.counted.inferences for r in rates)
        executions = sum(r.counted.executions for r in rates)
        seconds = rates[0].seconds if rates else math.nan
        busy = (
            100 * sum(r.counted.device_busy_seconds for r in rates) / seconds if rates else math.nan
        )
        batch = inferences / executions if executions else math.nan
        delay = decision.settings.dynamic_batching["max_queue_delay_microseconds"]
        marker = "*" if decision.switched else " "
        reason = decision.reason if len(decision.reason) < 70 else decision.reason[:67] + "..."
        return (
            f"{offset:6.0f}s {marker}{decision.profile:<12} {request_rate:6.0f} {p50:7.1f} "
            f"{p95:7.1f} {batch:6.1f} {busy:6.0f}% {delay:8d}  {reason}"
        )

    HEADER = (
        "  time   profile       req/s  p50 ms  p95 ms  batch  device  delay us  why\n"
        "         (* = switch)         (last 2 s, client side)  (device busy)"
    )


def _summary(view: _LiveView, result: loadgen.LoadResult) -> str:
    for record in result.records:
        if record.sent is None:
            continue
        profile = view.timeline.profile_at(record.sent)
        if profile is None:
            continue
        totals = view.totals.setdefault(profile, _ProfileTotals())
        if record.succeeded and record.latency is not None:
            totals.latencies.append(record.latency * 1000)
        else:
            totals.failed += 1
    lines = [
        "",
        "profile       seconds  requests  failed  req/s   p50 ms   p95 ms   p99 ms  "
        "avg batch  device busy  device-s/1k req",
    ]
    for profile, totals in sorted(view.totals.items()):
        requests = len(totals.latencies) + totals.failed
        p50, p95, p99 = (
            np.percentile(totals.latencies, [50, 95, 99]) if totals.latencies else [math.nan] * 3
        )
        batch = totals.inferences / totals.executions if totals.executions else math.nan
        busy = 100 * totals.device_seconds / totals.seconds if totals.seconds else math.nan
        per_thousand = (
            1000 * totals.device_seconds / totals.inferences if totals.inferences else math.nan
        )
        rate = requests / totals.seconds if totals.seconds else math.nan
        lines.append(
            f"{profile:<12} {totals.seconds:8.0f} {requests:9d} {totals.failed:7d} {rate:6.0f} "
            f"{p50:8.1f} {p95:8.1f} {p99:8.1f} {batch:10.1f} {busy:11.0f}% {per_thousand:16.2f}"
        )
    switches = ", ".join(
        f"{profile} at +{at:.0f}s ({source})" for at, profile, source in view.timeline.switches
    )
    summary = result.summary()
    lines += [
        "",
        f"switches: {switches}",
        f"all requests: {summary.describe()}",
        f"profiles applied: {', '.join(sorted({p for _, p, _ in view.timeline.switches}))}",
    ]
    return "\n".join(lines)


async def run_demo(
    *,
    short: bool,
    model: str,
    model_repository: Path,
    out: TextIO = sys.stdout,
    seed: int = 7,
) -> int:
    """Run the demo to completion; returns the exit status."""
    demo_plan = plan(now=datetime.datetime.now(datetime.UTC), short=short, model=model)
    spec = documents.parse_document(demo_plan.policy)
    out.write(f"Starting tritonserver (CPU) with {model} from {model_repository} ...\n")
    with local_triton.LocalTriton(model_repository=model_repository, models=[model]) as triton:
        phases = ", ".join(f"{p.rate:.0f} req/s for {p.seconds:.0f}s" for p in demo_plan.phases)
        out.write(
            f"Triton ready in {triton.startup_seconds or 0:.1f}s at {triton.http_url}; "
            f"log: {triton.log_path}\n"
            f"Policy: interactive by default; bulk while requestRate > 300 req/s; bulk by the "
            f"schedule from {demo_plan.window_opens:%H:%M} UTC.\n"
            f"Load: {phases} ({demo_plan.seconds:.0f}s)\n\n"
        )
        return await _drive(triton, spec, demo_plan, model, out, seed)


async def _drive(
    triton: local_triton.LocalTriton,
    spec: specs.BatchPolicySpec,
    demo_plan: Plan,
    model: str,
    out: TextIO,
    seed: int,
) -> int:
    server = servers.TritonServer(triton.http_url, metrics_url=triton.metrics_url)
    runner = running.Runner(
        name="demo",
        spec=spec,
        triton_servers=[server],
        source=sources.TritonMetricsSource([server], models=spec.target.models),
        metrics=telemetry.controller_metrics(),
    )
    load_started = time.monotonic()
    view = _LiveView(out, load_started)
    out.write(view.HEADER + "\n")
    stop = asyncio.Event()
    runner_task = asyncio.create_task(
        runner.run(interval=TICK_SECONDS, stop=stop, on_tick=view.tick)
    )
    async with server, aiohttp.ClientSession() as session:
        try:
            payload = await loadgen.payload_from_metadata(session, triton.http_url, model)
            result = await loadgen.run_load(
                base_url=triton.http_url,
                payload=payload,
                phases=demo_plan.phases,
                seed=seed,
                session=session,
                on_record=view.record,
            )
        finally:
            # The runner's last tick may still be reading the server: end it first.
            stop.set()
            await runner_task
    out.write(_summary(view, result) + "\n")
    applied = {profile for _, profile, _ in view.timeline.switches}
    return 0 if applied >= set(spec.profiles) else 1


def main(*, short: bool, model: str, model_repository: Path | None) -> int:
    """`batchpilot demo`; the runner's own log lines would drown the live view."""
    for chatty in ("batchpilot.runner", "batchpilot.rollouts"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    repository = model_repository or demo_models.MODEL_REPOSITORY
    if not (repository / model / "config.pbtxt").is_file():
        raise ValueError(
            f"no model {model!r} in {repository}; pass --model-repository pointing at "
            "manifests/model-repository of a batchpilot checkout"
        )
    return asyncio.run(run_demo(short=short, model=model, model_repository=repository))
