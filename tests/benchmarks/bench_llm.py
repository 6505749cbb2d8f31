"""An LLM trading day: analysts' questions during the session, filings summarised after the close.

A real vLLM engine behind Triton (`batchpilot_harness.llm_models`) serves both phases under each
configuration, one after another on one server:

- the session: questions (256 tokens with their retrieved context, 32-token answers) streamed
  at a steady rate, with a burst of them at once in its middle; what counts is the time to
  first token (TTFT) and the time between tokens;
- after the close: a backlog of summaries (long prompts, longer answers) submitted at once;
  what counts is how fast it drains (output tokens per second) and what it costs (the engine's
  busy CPU time, its "device-seconds", per 1,000 output tokens).

Configurations: every static profile of the sweep, held all day, and batchpilot, which runs
`interactive` during the session and `bulk` after the close, switched with the same actuator the
operator uses (a reload that overrides `model.json`) under the session's load, ahead of the close
by its morning reload into `interactive` x1.2 plus 3 s: the day of a policy whose `bulk` window
starts that much before the close (a schedule's lead time moves only changes into latency
profiles). batchpilot's day runs first and the static days after it, bulk first, so that no day
starts with a reload it does not need. TTFT comes from the client; inter-token latency from the
engine's own histogram (what the sidecar reads), since streamed tokens reach a client in
bunches. Figures are reported, never asserted.

    python tests/benchmarks/bench_llm.py            # 90 s sessions, three static profiles
    python tests/benchmarks/bench_llm.py --short    # 20 s sessions, static bulk only (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchmarking

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, engines
from batchpilot.policy import rendering
from batchpilot_harness import llm_load, llm_models, local_triton, procfs
from batchpilot_triton import scraping, servers

PROFILES: dict[str, dict[str, Any]] = {
    "interactive": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256, "chunkedPrefill": True},
    "balanced": {"maxNumSeqs": 16, "maxNumBatchedTokens": 1024, "chunkedPrefill": True},
    "bulk": {"maxNumSeqs": 48, "maxNumBatchedTokens": 4096, "chunkedPrefill": True},
}
SHORT_SWEEP = ("bulk",)
TTFT_OBJECTIVE_MS = 500.0
"""The session's objective: TTFT p95 within this, in every SLO window."""
SLO_WINDOW_SECONDS = 5.0
PLOT_WINDOW_SECONDS = 5.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    session_seconds: float
    question_rate: float
    burst: int
    backlog: int


SHAPES = {
    "full": Shape(session_seconds=90, question_rate=1, burst=8, backlog=160),
    "short": Shape(session_seconds=20, question_rate=1, burst=8, backlog=32),
}
QUESTION_TOKENS = (256, 32)
"""A question with its retrieved context: prompt and answer tokens."""
SUMMARY_TOKENS = (384, 64)
"""A filing's summary: prompt and output tokens."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase:
    seconds: float
    completions: int
    failed: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    slo_windows_met: float | None
    itl_p95_ms: float | None
    output_tokens: float
    output_tokens_per_second: float
    cpu_seconds_per_1000_tokens: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    """One plotted window of the day: when it starts (seconds from the open), the TTFT p95 of
    the requests sent in it, and the output tokens streamed in it per second."""

    start: float
    ttft_p95_ms: float | None
    output_tokens_per_second: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    configuration: str
    session: Phase
    after_close: Phase
    switch_seconds: float | None = None
    close_at: float = 0.0
    """Seconds from the open to the close (the backlog's submission)."""
    switch_at: float | None = None
    """Seconds from the open to the start of batchpilot's switch."""
    timeline: tuple[Window, ...] = ()


def metrics_page(server: local_triton.LocalTriton) -> scraping.Snapshot:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        return scraping.parse(response.read().decode(), taken_at=time.monotonic())


def engine_cpu(server: local_triton.LocalTriton) -> dict[int, float]:
    """CPU seconds of each of the server's processes: tritonserver, its stubs and their engine
    cores."""
    found = {}
    for pid in procfs.group_members(server.pid):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            found[pid] = procfs.cpu_seconds(pid)
    return found


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU time spent between two readings by the processes alive at the second (an engine that
    a reload ended meanwhile loses its last part)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def slo_windows(completions: Sequence[llm_load.Completion], started: float) -> float | None:
    """The share of SLO windows (by request start) whose TTFT p95 met the objective."""
    windows: dict[int, list[float]] = {}
    for completion in completions:
        if completion.ttft_seconds is not None:
            index = int((completion.sent_at - started) // SLO_WINDOW_SECONDS)
            windows.setdefault(index, []).append(1000 * completion.ttft_seconds)
    if not windows:
        return None
    met = sum(llm_load.percentile(ttfts, 0.95) <= TTFT_OBJECTIVE_MS for ttfts in windows.values())
    return met / len(windows)


def timeline(
    completions: Sequence[llm_load.Completion],
    *,
    started: float,
    width: float = PLOT_WINDOW_SECONDS,
) -> tuple[Window, ...]:
    """The day in windows of `width` seconds; a stream's tokens count evenly between its first
    and last token (they arrive in bunches of a few)."""
    ended = max((c.finished_at for c in completions), default=started)
    count = max(1, math.ceil((ended - started) / width))
    ttfts: list[list[float]] = [[] for _ in range(count)]
    tokens = [0.0] * count
    for completion in completions:
        if completion.first_token_at is None or completion.ttft_seconds is None:
            continue
        index = min(count - 1, int((completion.sent_at - started) // width))
        ttfts[index].append(1000 * completion.ttft_seconds)
        first, last = completion.first_token_at - started, (completion.last_token_at or 0) - started
        if last <= first:
            tokens[min(count - 1, int(first // width))] += completion.tokens
            continue
        for index in range(int(first // width), min(count - 1, int(last // width)) + 1):
            overlap = min(last, (index + 1) * width) - max(first, index * width)
            tokens[index] += completion.tokens * max(0.0, overlap) / (last - first)
    return tuple(
        Window(
            start=index * width,
            ttft_p95_ms=llm_load.percentile(ttfts[index], 0.95) if ttfts[index] else None,
            output_tokens_per_second=tokens[index] / width,
        )
        for index in range(count)
    )


def plot(runs: Sequence[Run], path: Path, *, shape: Shape) -> None:
    """TTFT p95 and output tokens/s over the day, one line per configuration; the close and
    batchpilot's switch marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, throughput) = plt.subplots(
        2, 1, figsize=(10, 6.2), sharex=True, height_ratios=(3, 2)
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        colour = colours[index % len(colours)]
        middles = [w.start + PLOT_WINDOW_SECONDS / 2 for w in run.timeline]
        # The session's TTFT: windows wholly before the close (the backlog's TTFT is its queue).
        session = [w for w in run.timeline if w.start + PLOT_WINDOW_SECONDS <= run.close_at]
        latency.plot(
            [w.start + PLOT_WINDOW_SECONDS / 2 for w in session],
            [math.nan if w.ttft_p95_ms is None else w.ttft_p95_ms for w in session],
            label=run.configuration,
            color=colour,
            linewidth=1.2,
            marker=".",
        )
        throughput.plot(
            middles, [w.output_tokens_per_second for w in run.timeline], color=colour, linewidth=1.2
        )
        if run.switch_at is not None and run.switch_seconds is not None:
            for axis in (latency, throughput):
                axis.axvspan(
                    run.switch_at, run.switch_at + run.switch_seconds, color=colour, alpha=0.12
                )
            latency.text(run.switch_at, 1.01, " switch (reload)", fontsize=8, color=colour,
                         transform=latency.get_xaxis_transform())  # fmt: skip
    close = min(run.close_at for run in runs)
    for axis in (latency, throughput):
        axis.axvline(close, color="black", linewidth=0.8, linestyle=":")
    latency.text(close, 1.01, " close: the last question answered, the backlog submitted",
                 fontsize=8, transform=latency.get_xaxis_transform())  # fmt: skip
    latency.axhline(TTFT_OBJECTIVE_MS, color="black", linewidth=0.8, linestyle="--")
    latency.text(0, TTFT_OBJECTIVE_MS, f" TTFT objective {TTFT_OBJECTIVE_MS:g} ms",
                 va="bottom", fontsize=8)  # fmt: skip
    latency.set_yscale("log")
    latency.set_ylabel(f"session TTFT p95 per {PLOT_WINDOW_SECONDS:g} s (ms)")
    throughput.set_ylabel("output tokens/s")
    throughput.set_xlabel(
        f"seconds from the open: a {shape.session_seconds:g}-s session (1 question/s, a burst of "
        f"{shape.burst} half-way), then {shape.backlog} summaries at once"
    )
    latency.legend(loc="upper left", fontsize=8, ncols=4)
    figure.suptitle("An LLM trading day on a real vLLM engine behind Triton (2 CPU cores)",
                    fontsize=10)  # fmt: skip
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def phase(
    completions: Sequence[llm_load.Completion],
    *,
    started: float,
    before: scraping.Snapshot,
    after: scraping.Snapshot,
    cpu_seconds: float,
) -> Phase:
    ended = max((c.finished_at for c in completions), default=started)
    ttfts = [1000 * c.ttft_seconds for c in completions if c.ttft_seconds is not None]
    tokens = float(sum(c.tokens for c in completions))
    engine = scraping.rates(before, after).get(llm_models.LLM_MODEL)
    itl = engine.engine.inter_token.quantile(0.95) if engine and engine.engine else None
    return Phase(
        seconds=ended - started,
        completions=len(completions),
        failed=sum(not c.ok for c in completions),
        ttft_p50_ms=llm_load.percentile(ttfts, 0.5) if ttfts else None,
        ttft_p95_ms=llm_load.percentile(ttfts, 0.95) if ttfts else None,
        slo_windows_met=slo_windows(completions, started),
        itl_p95_ms=None if itl is None else 1000 * itl,
        output_tokens=tokens,
        output_tokens_per_second=tokens / (ended - started) if ended > started else 0.0,
        cpu_seconds_per_1000_tokens=1000 * cpu_seconds / tokens if tokens else None,
    )


async def session(server: local_triton.LocalTriton, shape: Shape) -> list[llm_load.Completion]:
    """Questions at a steady rate, and a burst of them at once half-way."""

    async def burst() -> list[llm_load.Completion]:
        await asyncio.sleep(shape.session_seconds / 2)
        return await llm_load.open_loop(
            server.grpc_address,
            rate=1000,
            seconds=shape.burst / 1000,
            prompt_tokens=QUESTION_TOKENS[0],
            output_tokens=QUESTION_TOKENS[1],
        )

    steady, bursting = await asyncio.gather(
        llm_load.open_loop(
            server.grpc_address,
            rate=shape.question_rate,
            seconds=shape.session_seconds,
            prompt_tokens=QUESTION_TOKENS[0],
            output_tokens=QUESTION_TOKENS[1],
        ),
        burst(),
    )
    return steady + bursting


async def after_close(server: local_triton.LocalTriton, shape: Shape) -> list[llm_load.Completion]:
    """The backlog of summaries, all submitted at once."""
    return await llm_load.open_loop(
        server.grpc_address,
        rate=1000,
        seconds=shape.backlog / 1000,
        within=600,
        prompt_tokens=SUMMARY_TOKENS[0],
        output_tokens=SUMMARY_TOKENS[1],
    )


async def apply(server: local_triton.LocalTriton, profile: str) -> float:
    """Apply a profile with the operator's actuator; seconds it took."""
    settings = rendering.render(specs.Profile.model_validate({"llm": PROFILES[profile]}))
    async with servers.TritonServer(server.http_url, load_timeout=300) as triton:
        applied = await actuators.apply_profile(
            triton,
            llm_models.LLM_MODEL,
            settings,
            profile=profile,
            engine_arguments=engines.ModelRepository(server.model_repository),
            verify_timeout=300,
        )
    return applied.seconds


async def run_day(
    server: local_triton.LocalTriton,
    shape: Shape,
    *,
    session_profile: str,
    close_profile: str,
    lead_seconds: float = 0.0,
) -> Run:
    """One day; with two profiles the switch starts `lead_seconds` before the close, as the
    schedule's lead time does, so the backlog meets the bulk engine."""
    await apply(server, session_profile)
    before, cpu, started = metrics_page(server), engine_cpu(server), time.monotonic()
    switch: asyncio.Task[float] | None = None
    switch_at: float | None = None
    if close_profile != session_profile:

        async def ahead_of_the_close() -> float:
            nonlocal switch_at
            await asyncio.sleep(max(0.0, shape.session_seconds - lead_seconds))
            switch_at = time.monotonic() - started
            return await apply(server, close_profile)

        switch = asyncio.create_task(ahead_of_the_close())
    questions = await session(server, shape)
    switch_seconds = await switch if switch is not None else None
    middle, cpu_middle, closed = metrics_page(server), engine_cpu(server), time.monotonic()
    summaries = await after_close(server, shape)
    after, cpu_after = metrics_page(server), engine_cpu(server)
    name = session_profile if close_profile == session_profile else "batchpilot"
    return Run(
        configuration=name,
        session=phase(
            questions,
            started=started,
            before=before,
            after=middle,
            cpu_seconds=cpu_between(cpu, cpu_middle),
        ),
        after_close=phase(
            summaries,
            started=closed,
            before=middle,
            after=after,
            cpu_seconds=cpu_between(cpu_middle, cpu_after),
        ),
        switch_seconds=switch_seconds,
        close_at=closed - started,
        switch_at=switch_at,
        timeline=timeline([*questions, *summaries], started=started),
    )


def tables(runs: Sequence[Run], *, markdown: bool) -> str:
    render = benchmarking.markdown_table if markdown else benchmarking.table
    cell = benchmarking.cell
    session_rows = [
        [
            run.configuration,
            str(run.session.completions),
            str(run.session.failed),
            cell(run.session.ttft_p50_ms, 0),
            cell(run.session.ttft_p95_ms, 0),
            cell(
                None if run.session.slo_windows_met is None else 100 * run.session.slo_windows_met,
                0,
            ),
            cell(run.session.itl_p95_ms, 1),
        ]
        for run in runs
    ]
    close_rows = [
        [
            run.configuration,
            str(run.after_close.completions),
            str(run.after_close.failed),
            cell(run.after_close.seconds, 1),
            cell(run.after_close.output_tokens_per_second, 0),
            cell(run.after_close.cpu_seconds_per_1000_tokens, 2),
            cell(run.after_close.itl_p95_ms, 1),
            cell(run.switch_seconds, 1),
        ]
        for run in runs
    ]
    statics = [run for run in runs if run.configuration != "batchpilot"]
    pilot = next(run for run in runs if run.configuration == "batchpilot")
    best_bulk = max(statics, key=lambda run: run.after_close.output_tokens_per_second)
    throughput = benchmarking.ratio(
        pilot.after_close.output_tokens_per_second, best_bulk.after_close.output_tokens_per_second
    )
    cost = benchmarking.ratio(
        pilot.after_close.cpu_seconds_per_1000_tokens,
        best_bulk.after_close.cpu_seconds_per_1000_tokens,
    )
    return "\n\n".join(
        [
            f"session: TTFT objective p95 <= {TTFT_OBJECTIVE_MS:.0f} ms per "
            f"{SLO_WINDOW_SECONDS:.0f}-s window"
            " (TTFT from the client, inter-token from the engine)",
            render(
                [
                    "configuration",
                    "requests",
                    "failed",
                    "TTFT p50 ms",
                    "TTFT p95 ms",
                    "SLO windows met %",
                    "inter-token p95 ms",
                ],
                session_rows,
            ),
            "after the close: the backlog of summaries (CPU s = the engine's busy CPU time)",
            render(
                [
                    "configuration",
                    "requests",
                    "failed",
                    "drain s",
                    "output tok/s",
                    "CPU s / 1k tokens",
                    "inter-token p95 ms",
                    "switch s",
                ],
                close_rows,
            ),
            f"batchpilot / best static bulk ({best_bulk.configuration}): output tokens/s "
            f"{cell(throughput, 3)}x at {cell(cost, 3)}x its CPU time per token",
        ]
    )


async def benchmark(shape: Shape, sweep: Sequence[str], work: Path) -> list[Run]:
    """batchpilot's day first, then the static days, bulk first: a day that starts on the
    profile the last one ended on needs no reload (one takes about 40 s on these CPUs)."""
    repository = llm_models.write_repository(work)
    with llm_models.server(repository, run_directory=work / "run") as server:
        reload_seconds = await apply(server, "interactive")
        # A bulk window that starts this much before the close: the reload just seen, with a
        # margin.
        pilot = await run_day(
            server,
            shape,
            session_profile="interactive",
            close_profile="bulk",
            lead_seconds=1.2 * reload_seconds + 3,
        )
        statics = {
            name: await run_day(server, shape, session_profile=name, close_profile=name)
            for name in sorted(sweep, key=lambda name: name != "bulk")
        }
    return [*(statics[name] for name in sweep), pilot]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="20 s sessions, static bulk only")
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    shape = SHAPES["short" if arguments.short else "full"]
    sweep = SHORT_SWEEP if arguments.short else tuple(PROFILES)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as work:
        runs = asyncio.run(benchmark(shape, sweep, Path(work)))
    benchmarking.write_summary(
        out_dir,
        "summary-llm",
        tables=lambda markdown: tables(runs, markdown=markdown),
        data=[dataclasses.asdict(run) for run in runs],
    )
    plot(runs, out_dir / "day-llm.png", shape=shape)
    if arguments.publish:
        benchmarking.publish(out_dir, ["summary-llm.md", "day-llm.png"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
