"""Policy quality: one compressed trading day against real Triton, batched five ways.

The day (`trading_day`) is a Tuesday in New York from 08:00 to 20:30, replayed 150 times faster
than real time (300 s; `--speed` changes it; `--short`: 3,000 times, 15 s): quiet pre-market
traffic that picks up as desks arrive, the session with four bursts at three times its rate, the
closing rush and the quiet after it, then an off-hours backfill at five times the session's rate.
The arrivals are drawn once from a seed and replayed, request for request, against each
contender, each on a fresh tritonserver started for it, one after another:

- `no-batching`: the model's configuration with `dynamic_batching` removed (every request
  executes alone; `max_batch_size` stays, so requests keep their batch dimension);
- `static-interactive` and `static-bulk`: the policy's two profiles, each applied once;
- `best-static`: the configuration a sweep picks, the way Triton Model Analyzer would: it
  measures every (queue delay, preferred batch sizes) pair of a grid at the session's rate, its
  burst rate and the backfill rate, keeps those whose p95 meets the objective at the first two
  with no failed request, and ranks them by device-seconds per 1,000 requests at the backfill
  rate (Model Analyzer ranks by throughput under latency constraints; on one device serving
  open-loop traffic, more throughput per device-second is the same as fewer device-seconds per
  request);
- `batchpilot`: the standalone runner with `policy_document` — the XNYS schedule (interactive
  09:30-16:00, bulk otherwise), two load rules (backfill-level traffic takes bulk whatever the
  clock says; interactive-level traffic outside the session takes interactive), and SLO
  autotune of the interactive queue delay from a `batchpilot sidecar` watching the server. Its
  clock is the virtual day's, so the schedule, the rules' `for` and the dwell run compressed.

Per phase it reports p50/p95/p99 latency (client side), throughput, failed requests (never sent
because 512 were in flight counts as failed), the share of 10-second windows whose p95 meets the
objective with no failure, the average batch (Triton's counters) and device-seconds per 1,000
requests (the emulated device's busy time, `emulated_device_busy_seconds`). It prints the ratios
batchpilot / best-static, the targets and whether they were met, and writes `summary-<model>.json`,
`summary-<model>.md` and a plot of the day (`day-<model>.png`) into `--out`.

    python tests/benchmarks/bench_policy.py                       # gpu_sim, about 32 minutes
    python tests/benchmarks/bench_policy.py --short               # CI: about 2 minutes
    python tests/benchmarks/bench_policy.py --speed 300           # a 150 s day: 20 minutes
    python tests/benchmarks/bench_policy.py --model torch_mlp     # the real torch model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import benchmarking

from batchpilot import running, telemetry
from batchpilot.api import documents, names, v1alpha1
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators
from batchpilot.policy import rendering
from batchpilot.signals import sidecars
from batchpilot_harness import demo_models, loadgen, local_sidecar, local_triton
from batchpilot_triton import scraping, servers

REPO = Path(__file__).resolve().parents[2]

SLO_MS = 25.0
"""The interactive objective: p95 latency as the client sees it."""
POLICY_SLO_MS = 20.0
"""The objective autotune is given. The sidecar budgets queue delay + step time + a margin, all
server-side; the 5 ms below SLO_MS leave room for HTTP and JSON on a shared 2-core machine."""
SEED = 20261117
PLOT_POINTS = 75
"""Windows per day in the plot: 4 s each in the full run."""

PROFILES: dict[str, dict[str, Any]] = {
    "interactive": {"maxQueueDelayMicroseconds": 2000, "preferredBatchSizes": [4, 8]},
    "bulk": {"maxQueueDelayMicroseconds": 50000, "preferredBatchSizes": [64, 128]},
}


def trading_day(*, short: bool, speed: float | None = None) -> benchmarking.TradingDay:
    at = datetime.time
    session = 150.0
    return benchmarking.TradingDay(
        date=datetime.date(2026, 11, 17),  # a Tuesday with a full XNYS session
        timezone="America/New_York",
        phases=(
            benchmarking.DayPhase(name="pre-market", start=at(8), end=at(9, 30), rate=40),
            benchmarking.DayPhase(name="session", start=at(9, 30), end=at(15, 45), rate=session),
            benchmarking.DayPhase(name="close", start=at(15, 45), end=at(16, 30), rate=60),
            benchmarking.DayPhase(name="backfill", start=at(16, 30), end=at(20, 30), rate=750),
        ),
        bursts=(
            benchmarking.Burst(label="desks arrive", start=at(8, 45), end=at(9, 30), rate=session),
            *(
                benchmarking.Burst(
                    label="burst", start=at(hour, minute), end=at(hour, minute + 10), rate=450
                )
                for hour, minute in ((10, 0), (11, 30), (13, 0), (14, 30))
            ),
            benchmarking.Burst(label="closing rush", start=at(15, 45), end=at(16), rate=300),
        ),
        speed=speed or (3000.0 if short else 150.0),
    )


def policy_document(model: str, *, speed: float = 1.0) -> dict[str, Any]:
    """batchpilot's policy for the day; durations are in the virtual day's time. The SLO guard
    waits for a p95 measured under the delay in force, and Triton's latency summaries cover
    about the last minute of real time: `speed` minutes of the day."""
    return {
        "apiVersion": v1alpha1.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "trading-day"},
        "spec": {
            "target": {"selector": {"matchLabels": {"app": "triton"}}, "models": [model]},
            "profiles": PROFILES,
            "defaultProfile": "bulk",
            "schedule": {
                "timezone": "America/New_York",
                "calendar": "XNYS",
                "windows": [
                    {
                        "profile": "interactive",
                        "days": ["Mon", "Tue", "Wed", "Thu", "Fri"],
                        "start": "09:30",
                        "end": "16:00",
                    }
                ],
            },
            "load": {
                "source": "sidecar",
                "rules": [
                    # Backfill-level traffic is bulk work, whatever the clock says; first, so
                    # that it wins over the next rule when both hold.
                    {
                        "profile": "bulk",
                        "metric": "requestRate",
                        "above": 600,
                        "below": 300,
                        "for": "1m",
                    },
                    # Desks busy outside the session (pre-open, news) get interactive early:
                    # the switch happens before the bell, not in the first minute of trading.
                    # Its `for` is long enough that a backfill starting is bulk's, not its.
                    {
                        "profile": "interactive",
                        "metric": "requestRate",
                        "above": 120,
                        "below": 80,
                        "for": "20m",
                    },
                ],
            },
            "slo": {
                "p95LatencyMs": POLICY_SLO_MS,
                "profiles": ["interactive"],
                "autotune": True,
                "minQueueDelayMicroseconds": 500,
                "maxQueueDelayMicroseconds": 10000,
                "guardIntervalSeconds": min(math.ceil(SUMMARY_WINDOW_SECONDS * speed), 86_400),
            },
            "minDwellSeconds": 600,
        },
    }


# -- configurations ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A static batching configuration; `delay_us=None` means no dynamic batching at all."""

    delay_us: int | None
    preferred: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.delay_us is None:
            return "no dynamic batching"
        return f"delay {self.delay_us} us, preferred {','.join(map(str, self.preferred))}"

    @property
    def key(self) -> str:
        if self.delay_us is None:
            return "none"
        return f"{self.delay_us}us/{'-'.join(map(str, self.preferred))}"

    def settings(self) -> rendering.Settings:
        assert self.delay_us is not None
        profile = specs.Profile.model_validate(
            {"maxQueueDelayMicroseconds": self.delay_us, "preferredBatchSizes": self.preferred}
        )
        return rendering.render(profile)

    @classmethod
    def of_profile(cls, name: str) -> Config:
        profile = PROFILES[name]
        return cls(
            delay_us=profile["maxQueueDelayMicroseconds"],
            preferred=tuple(profile["preferredBatchSizes"]),
        )


NO_BATCHING = Config(delay_us=None)


def grid(*, short: bool) -> list[Config]:
    if short:
        return [Config(delay_us=d, preferred=p) for d, p in ((2000, (4, 8)), (10000, (16, 32)))]
    return [
        Config(delay_us=delay, preferred=preferred)
        for delay in (1000, 2000, 5000, 10000, 20000, 50000)
        for preferred in ((4, 8), (16, 32), (64, 128))
    ]


async def configure(server: servers.TritonServer, model: str, config: Config) -> None:
    """Make the server run `config` (a reload with a configuration override)."""
    if config.delay_us is not None:
        await actuators.apply_profile(server, model, config.settings(), profile=config.key)
        return
    served = await server.model_config(model)
    served.pop("dynamic_batching", None)
    await server.load(model, served)
    reloaded = await server.model_config(model)
    if "dynamic_batching" in reloaded or not reloaded.get("max_batch_size"):
        raise RuntimeError(f"Triton did not take the configuration without batching: {reloaded}")


# -- the sweep --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    label: str
    rate: float
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeResult:
    label: str
    p95_ms: float | None
    failed: int
    device_seconds_per_1000: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepResult:
    config: Config
    probes: tuple[ProbeResult, ...]

    def probe(self, label: str) -> ProbeResult:
        return next(p for p in self.probes if p.label == label)

    def feasible(self, slo_ms: float) -> bool:
        latency_bound = [self.probe("session"), self.probe("burst")]
        return all(
            p.failed == 0 and p.p95_ms is not None and p.p95_ms <= slo_ms for p in latency_bound
        ) and (self.probe("backfill").failed == 0)


def probes(day: benchmarking.TradingDay, *, short: bool) -> list[Probe]:
    """The day's session rate, burst rate and backfill rate, a few seconds each."""
    rates = {segment.label: segment.rate for segment in day.segments()}
    seconds = (2.5, 2.0, 2.5) if short else (8.0, 5.0, 8.0)
    return [
        Probe(label="session", rate=rates["session"], seconds=seconds[0]),
        Probe(label="burst", rate=rates["burst"], seconds=seconds[1]),
        Probe(label="backfill", rate=rates["backfill"], seconds=seconds[2]),
    ]


def pick(results: Sequence[SweepResult], slo_ms: float) -> SweepResult:
    """Model Analyzer's way: within the latency constraint, the most efficient; if nothing meets
    the constraint, the one closest to it."""
    feasible = [r for r in results if r.feasible(slo_ms)]
    if feasible:
        return min(
            feasible, key=lambda r: r.probe("backfill").device_seconds_per_1000 or float("inf")
        )
    return min(results, key=lambda r: r.probe("burst").p95_ms or float("inf"))


Served = tuple[
    local_triton.LocalTriton, servers.TritonServer, aiohttp.ClientSession, loadgen.InferencePayload
]
"""A local Triton serving one model alone; a client of it, an HTTP session and a payload that
fits the model."""


@contextlib.asynccontextmanager
async def fresh_server(model: str) -> AsyncIterator[Served]:
    with local_triton.LocalTriton(
        model_repository=demo_models.MODEL_REPOSITORY, models=[model]
    ) as triton:
        server = servers.TritonServer(triton.http_url, metrics_url=triton.metrics_url)
        async with server, aiohttp.ClientSession() as session:
            payload = await loadgen.payload_from_metadata(session, triton.http_url, model)
            yield triton, server, session, payload


async def sweep(
    model: str, configs: Sequence[Config], plan: Sequence[Probe], out: Any
) -> list[SweepResult]:
    results = []
    async with fresh_server(model) as (triton, server, session, payload):
        for index, config in enumerate(configs):
            await configure(server, model, config)
            found = []
            for probe in plan:
                before = scraping.parse(await server.metrics_text())
                load = await loadgen.run_load(
                    base_url=triton.http_url,
                    payload=payload,
                    phases=[loadgen.Phase(rate=probe.rate, seconds=probe.seconds)],
                    seed=SEED + index,
                    session=session,
                )
                after = scraping.parse(await server.metrics_text())
                summary = load.summary()
                found.append(
                    ProbeResult(
                        label=probe.label,
                        p95_ms=summary.latency_p95_ms,
                        failed=summary.failed + summary.not_sent,
                        device_seconds_per_1000=scraping.increase(
                            before, after, model
                        ).device_seconds_per_1000_inferences,
                    )
                )
            result = SweepResult(config=config, probes=tuple(found))
            results.append(result)
            out.write(
                f"  sweep {index + 1}/{len(configs)} {config.describe():<32}"
                + "".join(
                    f"  {p.label} p95 {benchmarking.cell(p.p95_ms)} ms"
                    + (f" ({p.failed} failed)" if p.failed else "")
                    for p in found
                )
                + f"  backfill device-s/1k "
                f"{benchmarking.cell(result.probe('backfill').device_seconds_per_1000, 3)}\n"
            )
            out.flush()
    return results


# -- replaying the day ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Switch:
    offset: float
    profile: str
    delay_us: int
    reason: str
    reloads: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replay:
    contender: str
    description: str
    records: tuple[loadgen.RequestRecord, ...]
    series: tuple[scraping.Snapshot, ...]
    switches: tuple[Switch, ...] = ()


async def _scrape(
    server: servers.TritonServer,
    origin: float,
    series: list[scraping.Snapshot],
    stop: asyncio.Event,
    interval: float = 1.0,
) -> None:
    """A snapshot now and every `interval` seconds until stopped, and a last one then."""
    while True:
        page = await server.metrics_text()
        series.append(scraping.parse(page, taken_at=time.monotonic() - origin))
        if stop.is_set():
            return
        # Scrape on the grid of whole intervals after the origin, not drifting off it.
        elapsed = time.monotonic() - origin
        wait = interval - (elapsed % interval) if elapsed > 0 else -elapsed
        try:
            await asyncio.wait_for(stop.wait(), timeout=wait)
        except TimeoutError:
            continue


SUMMARY_WINDOW_SECONDS = 60.0
"""Real seconds Triton's latency summaries (the p95 the sidecar reports) describe."""


def signal_window(day: benchmarking.TradingDay) -> float:
    """Wall seconds over which the sidecar measures rates: 2.5 minutes of the virtual day, but
    at least 0.25 s (fewer requests make noisy rates) and at most 1 s. The runner ticks, and
    the sidecar reads Triton, twice per window."""
    return min(max(150.0 / day.speed, 0.25), 1.0)


async def replay(
    *,
    day: benchmarking.TradingDay,
    model: str,
    contender: str,
    config: Config | None,
    out_dir: Path,
) -> Replay:
    """The day against a fresh server: `config` applied once, or batchpilot when it is None."""
    async with fresh_server(model) as (triton, server, session, payload):
        if config is not None:
            await configure(server, model, config)
            return await _drive(day, triton, server, payload, session, contender, config)
        window = signal_window(day)
        # The sidecar reads Triton twice per rate window, as the runner ticks.
        rates = ("--interval", f"{window / 2:g}", "--rate-window", f"{window:g}")
        with local_sidecar.running(
            triton, "--models", model, *rates, log=out_dir / f"sidecar-{model}.log"
        ) as sidecar:
            return await _drive_batchpilot(
                day, triton, server, payload, session, sidecar, model, window / 2
            )


async def _drive(
    day: benchmarking.TradingDay,
    triton: local_triton.LocalTriton,
    server: servers.TritonServer,
    payload: loadgen.InferencePayload,
    session: aiohttp.ClientSession,
    contender: str,
    config: Config,
) -> Replay:
    records, series = await _load_the_day(day, triton, server, payload, session)
    return Replay(
        contender=contender, description=config.describe(), records=records, series=series
    )


async def _load_the_day(
    day: benchmarking.TradingDay,
    triton: local_triton.LocalTriton,
    server: servers.TritonServer,
    payload: loadgen.InferencePayload,
    session: aiohttp.ClientSession,
    *,
    alongside: Callable[[float, asyncio.Event], Coroutine[Any, Any, None]] | None = None,
) -> tuple[tuple[loadgen.RequestRecord, ...], tuple[scraping.Snapshot, ...]]:
    """The day's arrivals against the server, its metrics scraped once a second meanwhile;
    `alongside(origin, stop)` runs too (batchpilot's runner) until `stop` is set when the load
    has ended. `origin` is the `time.monotonic()` the load's offsets count from."""
    origin = time.monotonic()
    series: list[scraping.Snapshot] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_scrape(server, origin, series, stop))]
    if alongside is not None:
        tasks.append(asyncio.create_task(alongside(origin, stop)))
    try:
        result = await loadgen.run_load(
            base_url=triton.http_url,
            payload=payload,
            phases=day.load_phases(),
            seed=SEED,
            session=session,
        )
    finally:
        stop.set()
        for task in tasks:
            await task
    return result.records, tuple(series)


async def _drive_batchpilot(
    day: benchmarking.TradingDay,
    triton: local_triton.LocalTriton,
    server: servers.TritonServer,
    payload: loadgen.InferencePayload,
    session: aiohttp.ClientSession,
    sidecar: local_sidecar.LocalSidecar,
    model: str,
    tick_seconds: float,
) -> Replay:
    spec = documents.parse_document(policy_document(model, speed=day.speed))
    source = sidecars.SidecarSource([sidecar.url], models=[model], slo=spec.slo)
    origin = float("inf")  # the clock reads the start of the day until the load starts
    runner = running.Runner(
        name="trading-day",
        spec=spec,
        triton_servers=[server],
        source=source,
        metrics=telemetry.controller_metrics(),
        clock=lambda: day.virtual(max(time.monotonic() - origin, 0.0)),
    )
    switches: list[Switch] = []

    def note(report: running.TickReport) -> None:
        reloads = sum(outcome.reloads for outcome in report.outcomes)
        if report.decision.switched or reloads:
            switches.append(
                Switch(
                    offset=(report.at - day.start).total_seconds() / day.speed,
                    profile=report.decision.profile,
                    delay_us=report.decision.settings.dynamic_batching[
                        "max_queue_delay_microseconds"
                    ],
                    reason=report.decision.reason,
                    reloads=reloads,
                )
            )

    async def run_from(started: float, stop: asyncio.Event) -> None:
        nonlocal origin
        origin = started  # the runner's clock now follows the day
        await runner.run(interval=tick_seconds, stop=stop, on_tick=note)

    try:
        note(await runner.tick())  # the day's first decision, applied before the traffic
        records, series = await _load_the_day(
            day, triton, server, payload, session, alongside=run_from
        )
    finally:
        await source.close()
    return Replay(
        contender="batchpilot",
        description="schedule + load rules + SLO autotune",
        records=records,
        series=series,
        switches=tuple(switches),
    )


# -- reporting --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContenderReport:
    contender: str
    description: str
    phases: tuple[benchmarking.PhaseReport, ...]
    timeline: benchmarking.Timeline
    switches: tuple[Switch, ...]

    def phase(self, name: str) -> benchmarking.PhaseReport:
        return next(p for p in self.phases if p.phase == name)


def account(day: benchmarking.TradingDay, model: str, run: Replay) -> ContenderReport:
    phases = tuple(
        benchmarking.phase_report(
            name=phase.name,
            records=run.records,
            series=run.series,
            model=model,
            start=day.bounds(index)[0],
            end=day.bounds(index)[1],
            slo_ms=SLO_MS,
        )
        for index, phase in enumerate(day.phases)
    )
    timeline = benchmarking.Timeline(
        label=run.contender,
        windows=tuple(
            benchmarking.windows(
                run.records, start=0.0, end=day.seconds, width=day.seconds / PLOT_POINTS
            )
        ),
    )
    return ContenderReport(
        contender=run.contender,
        description=run.description,
        phases=phases,
        timeline=timeline,
        switches=run.switches,
    )


PHASE_HEADERS = (
    "contender",
    "req",
    "failed",
    "req/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "SLO windows",
    "avg batch",
    "device-s/1k",
)


def phase_rows(reports: Sequence[ContenderReport], phase: str) -> list[list[str]]:
    rows = []
    for report in reports:
        p = report.phase(phase)
        rows.append(
            [
                report.contender,
                str(p.requests),
                str(p.failed),
                benchmarking.cell(p.throughput),
                benchmarking.cell(p.p50_ms),
                benchmarking.cell(p.p95_ms),
                benchmarking.cell(p.p99_ms),
                f"{p.windows_meeting_slo}/{p.windows}",
                benchmarking.cell(p.average_batch),
                benchmarking.cell(p.device_seconds_per_1000, 3),
            ]
        )
    return rows


RATIO_FIELDS = (
    ("p95 ms", "p95_ms"),
    ("p99 ms", "p99_ms"),
    ("req/s", "throughput"),
    ("SLO windows", "share_meeting_slo"),
    ("device-s/1k", "device_seconds_per_1000"),
)


def ratio_rows(
    reports: Sequence[ContenderReport], day: benchmarking.TradingDay
) -> tuple[list[str], list[list[str]]]:
    ours = next(r for r in reports if r.contender == "batchpilot")
    best = next(r for r in reports if r.contender == "best-static")
    rows = []
    for phase in day.phases:
        row = [phase.name]
        for _, attribute in RATIO_FIELDS:
            value = benchmarking.ratio(
                getattr(ours.phase(phase.name), attribute),
                getattr(best.phase(phase.name), attribute),
            )
            row.append(benchmarking.cell(value, 2))
        rows.append(row)
    return ["phase", *(label for label, _ in RATIO_FIELDS)], rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    target: str
    measured: str
    met: bool | None  # None: not measurable in this run


def verdicts(reports: Sequence[ContenderReport]) -> list[Verdict]:
    """The issue's targets, judged on this run (reported, never asserted)."""
    by_name = {r.contender: r for r in reports}
    ours = by_name["batchpilot"]
    statics = [r for r in reports if r.contender not in ("batchpilot", "no-batching")]

    def interactive_ok(report: ContenderReport) -> bool:
        share = report.phase("session").share_meeting_slo
        return share is not None and share >= 0.99

    backfill = [r for r in statics if r.phase("backfill").device_seconds_per_1000 is not None]
    best_bulk = min(
        backfill, key=lambda r: r.phase("backfill").device_seconds_per_1000 or float("inf")
    )
    reference = best_bulk.phase("backfill")

    def bulk_ok(report: ContenderReport) -> bool:
        mine = report.phase("backfill")
        device = benchmarking.ratio(mine.device_seconds_per_1000, reference.device_seconds_per_1000)
        served = benchmarking.ratio(mine.throughput, reference.throughput)
        return device is not None and served is not None and device <= 1.05 and served >= 0.95

    session = ours.phase("session")
    mine = ours.phase("backfill")
    both = [r.contender for r in statics if interactive_ok(r) and bulk_ok(r)]
    return [
        Verdict(
            target="interactive: p95 within the SLO in >= 99% of 10 s windows",
            measured=f"{session.windows_meeting_slo}/{session.windows} windows "
            f"({100 * (session.share_meeting_slo or 0):.0f}%)",
            met=interactive_ok(ours),
        ),
        Verdict(
            target=f"backfill: device-s/1k within 5% of the best static bulk config "
            f"({best_bulk.contender}), at >= 95% of its throughput",
            measured=f"device-s/1k x{benchmarking.cell(benchmarking.ratio(mine.device_seconds_per_1000, reference.device_seconds_per_1000), 3)}, "  # noqa: E501
            f"throughput x{benchmarking.cell(benchmarking.ratio(mine.throughput, reference.throughput), 3)}",  # noqa: E501
            met=bulk_ok(ours),
        ),
        Verdict(
            target="no single static config achieves both",
            measured=f"static configs achieving both: {', '.join(both) or 'none'}",
            met=not both,
        ),
    ]


def render(
    *,
    day: benchmarking.TradingDay,
    model: str,
    reports: Sequence[ContenderReport],
    sweep_results: Sequence[SweepResult],
    chosen: SweepResult,
    markdown: bool,
) -> str:
    """The figures as text: terminal tables, or Markdown for the README."""
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    lines = [
        f"model {model}; SLO p95 {SLO_MS:g} ms (client side, per 10 s window); "
        f"day {day.phases[0].start:%H:%M}-{day.phases[-1].end:%H:%M} {day.timezone} "
        f"replayed {day.speed:g}x ({day.seconds:.0f} s per contender)",
        "",
        "contenders: "
        + "; ".join(f"{report.contender} = {report.description}" for report in reports),
        f"best-static: picked from {len(sweep_results)} configs, "
        f"{sum(r.feasible(SLO_MS) for r in sweep_results)} meeting the SLO at the session and "
        f"burst rates: {chosen.config.describe()}",
    ]
    for index, phase in enumerate(day.phases):
        start, end = day.bounds(index)
        lines += [
            "",
            f"{phase.name} ({phase.start:%H:%M}-{phase.end:%H:%M}, {end - start:.0f} s, "
            f"base {phase.rate:g} req/s)",
            "",
            tabulate(PHASE_HEADERS, phase_rows(reports, phase.name)),
        ]
    headers, rows = ratio_rows(reports, day)
    lines += ["", "batchpilot / best-static", "", tabulate(headers, rows), ""]
    for verdict in verdicts(reports):
        met = {True: "met", False: "MISSED", None: "n/a"}[verdict.met]
        lines.append(f"- {verdict.target}: {verdict.measured} -> {met}")
    ours = next(r for r in reports if r.contender == "batchpilot")
    if ours.switches:
        lines += ["", "batchpilot's reloads:"]
        lines += [
            f"- {day.label(s.offset)} (+{s.offset:.1f} s) {s.profile}, delay {s.delay_us} us, "
            f"{s.reloads} reload(s): {s.reason}"
            for s in ours.switches
        ]
    return "\n".join(lines)


def summary_json(
    *,
    day: benchmarking.TradingDay,
    model: str,
    reports: Sequence[ContenderReport],
    sweep_results: Sequence[SweepResult],
    chosen: SweepResult,
    seconds: float,
) -> dict[str, Any]:
    return {
        "model": model,
        "slo_ms": SLO_MS,
        "speed": day.speed,
        "day_seconds": day.seconds,
        "wall_seconds": seconds,
        "sweep": [
            {"config": r.config.describe(), "probes": [dataclasses.asdict(p) for p in r.probes]}
            for r in sweep_results
        ],
        "best_static": chosen.config.describe(),
        "contenders": [
            {
                "contender": r.contender,
                "description": r.description,
                "phases": [
                    {**dataclasses.asdict(p), "share_meeting_slo": p.share_meeting_slo}
                    for p in r.phases
                ],
                "switches": [dataclasses.asdict(s) for s in r.switches],
            }
            for r in reports
        ],
        "targets": [dataclasses.asdict(v) for v in verdicts(reports)],
    }


# -- the command ------------------------------------------------------------------------------


async def benchmark(arguments: argparse.Namespace) -> int:
    out = sys.stdout
    started = time.monotonic()
    model: str = arguments.model
    day = trading_day(short=arguments.short, speed=arguments.speed)
    out_dir: Path = arguments.out
    out.write(
        f"policy benchmark, {model}: a {day.seconds:.0f} s day per contender on a fresh "
        f"tritonserver (nvidia-pytriton {local_triton.find_distribution().version}, CPU)\n"
    )
    plan = probes(day, short=arguments.short)
    out.write(
        f"sweep ({', '.join(f'{p.label} {p.rate:g} req/s for {p.seconds:g} s' for p in plan)}):\n"
    )
    sweep_results = await sweep(model, grid(short=arguments.short), plan, out)
    chosen = pick(sweep_results, SLO_MS)
    out.write(f"best static config: {chosen.config.describe()}\n")

    contenders: list[tuple[str, Config | None]] = [
        ("no-batching", NO_BATCHING),
        ("static-interactive", Config.of_profile("interactive")),
        ("static-bulk", Config.of_profile("bulk")),
        ("best-static", chosen.config),
        ("batchpilot", None),
    ]
    reports = []
    for name, config in contenders:
        run_started = time.monotonic()
        run = await replay(
            day=day,
            model=model,
            contender=name,
            config=config,
            out_dir=out_dir,
        )
        report = account(day, model, run)
        reports.append(report)
        failed = benchmarking.failures(run.records)
        out.write(
            f"  {name:<19} {len(run.records)} requests, {failed} failed "
            f"({time.monotonic() - run_started:.0f} s)\n"
        )
        out.flush()

    tables = functools.partial(
        render, day=day, model=model, reports=reports, sweep_results=sweep_results, chosen=chosen
    )
    seconds = time.monotonic() - started
    benchmarking.write_summary(
        out_dir,
        f"summary-{model}",
        tables=tables,
        out=out,
        data=summary_json(
            day=day,
            model=model,
            reports=reports,
            sweep_results=sweep_results,
            chosen=chosen,
            seconds=seconds,
        ),
    )
    plot = out_dir / f"day-{model}.png"
    ours = next(r for r in reports if r.contender == "batchpilot")
    benchmarking.plot_day(
        plot,
        day=day,
        timelines=[r.timeline for r in reports],
        slo_ms=SLO_MS,
        title=f"{model}: the same trading day against five batching configurations "
        "(dotted: batchpilot's reloads)",
        markers={"batchpilot": [(s.offset, s.profile) for s in ours.switches]},
    )
    if arguments.publish:
        benchmarking.publish(out_dir, [plot.name, f"summary-{model}.md"])
    out.write(f"\nwrote {out_dir}/summary-{model}.{{md,json}} and {plot}; {seconds:.0f} s\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Policy quality: a compressed trading day against five batching setups."
    )
    parser.add_argument("--short", action="store_true", help="a 15 s day and a 2-config sweep")
    parser.add_argument(
        "--speed", type=float, help="how much faster than real time (default 150; --short: 3000)"
    )
    parser.add_argument(
        "--model", choices=(demo_models.GPU_SIM, demo_models.TORCH_MLP), default="gpu_sim"
    )
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    logging.getLogger("batchpilot.runner").setLevel(logging.WARNING)
    arguments.out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(benchmark(arguments))


if __name__ == "__main__":
    sys.exit(main())
