"""`batchpilot demo --model llm`: a real vLLM engine behind Triton, from interactive to bulk.

A local tritonserver serves `tiny_llm` (a dummy-weight Llama on a real vLLM engine, on the CPU).
The policy runs `interactive` (few sequences, small prefill chunks: answers start fast) and
opens a `bulk` window (many sequences, big steps: more tokens per second) at a minute boundary,
like a market close, with a lead time so that the reload is over when it opens. Analysts'
questions stream in until then; at the close a backlog of filings to summarise arrives. The
standalone runner applies each profile by reloading the model with a new `model.json`, under that
load. One line per second shows the profile the server serves (from its config), TTFT as the
client sees it, and the engine's own tokens per second and running and waiting sequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from batchpilot import running, telemetry
from batchpilot.api import documents, names, v1alpha1
from batchpilot.signals import sources
from batchpilot_harness import llm_load, llm_models, local_triton
from batchpilot_triton import modelconfigs, scraping, servers

PROFILES = {
    "interactive": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256, "chunkedPrefill": True},
    "bulk": {"maxNumSeqs": 48, "maxNumBatchedTokens": 4096, "chunkedPrefill": True},
}
QUESTION_RATE = 3.0
BACKLOG = 64
LEAD_TIME = "90s"
"""Start the reload this far ahead of the window: an engine takes 20-60 s to start here under
load, and `auto` has measured nothing before the first switch."""
_RECENT_SECONDS = 5.0


def policy(window_opens: datetime.datetime) -> dict[str, Any]:
    closes = window_opens + datetime.timedelta(minutes=3)
    return {
        "apiVersion": v1alpha1.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "llm-demo"},
        "spec": {
            "target": {
                "selector": {"matchLabels": {"app": "triton"}},
                "models": [llm_models.LLM_MODEL],
            },
            "profiles": {name: {"llm": llm} for name, llm in PROFILES.items()},
            "defaultProfile": "interactive",
            "schedule": {
                "timezone": "UTC",
                "leadTime": LEAD_TIME,
                "windows": [
                    {
                        "profile": "bulk",
                        "start": window_opens.strftime("%H:%M"),
                        "end": closes.strftime("%H:%M"),
                    }
                ],
            },
            "minDwellSeconds": 0,
        },
    }


class _View:
    """One line a second, from the server itself: the profile it serves (its config), the TTFT
    its clients saw, and its engine's own metrics."""

    HEADER = (
        "  time   serving       questions/s  TTFT p50 ms  TTFT p95 ms  engine tok/s  running"
        "  waiting\n"
        "         (* = switch)  (client, last 5 s)                     (engine's own metrics)"
    )

    def __init__(self, out: TextIO, started: float) -> None:
        self.out = out
        self.started = started
        self.completions: list[llm_load.Completion] = []
        self.switches: list[tuple[float, str]] = []
        """(offset, profile) each time the served profile changed."""
        self.decisions: list[str] = []

    def tick(self, report: running.TickReport) -> None:
        if report.decision.switched:
            offset = time.monotonic() - self.started
            self.decisions.append(
                f"{offset:.0f}s: decided {report.decision.profile}: {report.decision.reason}"
            )
            self.out.write(f"         {self.decisions[-1]}\n")

    def profile_at(self, offset: float) -> str | None:
        current = None
        for at, profile in self.switches:
            if at <= offset:
                current = profile
        return current

    async def watch(self, server: servers.TritonServer, stop: asyncio.Event) -> None:
        previous: scraping.Snapshot | None = None
        serving: str | None = None
        while not stop.is_set():
            now = time.monotonic()
            try:
                page, config = await asyncio.gather(
                    server.metrics_text(), server.model_config(llm_models.LLM_MODEL)
                )
            except servers.TritonError:
                page, config = None, None
            snapshot = scraping.parse(page, taken_at=now) if page is not None else None
            rates = (
                scraping.rates(previous, snapshot).get(llm_models.LLM_MODEL)
                if previous is not None and snapshot is not None
                else None
            )
            previous = snapshot
            profile = modelconfigs.applied_profile(config) if config else serving
            marker = " "
            if profile is not None and profile != serving:
                self.switches.append((now - self.started, profile))
                serving, marker = profile, "*"
            self._line(now, serving, marker, rates)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, now + 1.0 - time.monotonic()))

    def _line(
        self, now: float, serving: str | None, marker: str, rates: scraping.ModelRates | None
    ) -> None:
        recent = [c for c in self.completions if c.finished_at > now - _RECENT_SECONDS]
        ttfts = [1000 * c.ttft_seconds for c in recent if c.ttft_seconds is not None]
        engine = rates.engine if rates is not None else None
        tokens = engine.generation_tokens / rates.seconds if engine and rates else math.nan
        self.out.write(
            f"{now - self.started:6.0f}s {marker}{serving or '(repository)':<12} "
            f"{len(recent) / _RECENT_SECONDS:11.1f} "
            f"{llm_load.percentile(ttfts, 0.5):12.0f} {llm_load.percentile(ttfts, 0.95):12.0f} "
            f"{tokens:13.0f} {engine.running if engine else math.nan:8.0f} "
            f"{engine.waiting if engine else math.nan:8.0f}\n"
        )
        self.out.flush()


async def _load(
    server: local_triton.LocalTriton,
    view: _View,
    window_opens: float,
) -> list[llm_load.Completion]:
    """Questions until the window opens (the close), then the backlog of summaries."""

    async def backlog() -> list[llm_load.Completion]:
        await asyncio.sleep(max(0.0, window_opens - time.monotonic()))
        return await llm_load.open_loop(
            server.grpc_address,
            rate=1000,
            seconds=BACKLOG / 1000,
            prompt_tokens=384,
            output_tokens=64,
            within=600,
            on_completion=view.completions.append,
        )

    questions = llm_load.open_loop(
        server.grpc_address,
        rate=QUESTION_RATE,
        seconds=max(1.0, window_opens - time.monotonic()),
        prompt_tokens=64,
        output_tokens=32,
        on_completion=view.completions.append,
    )
    asked, summarised = await asyncio.gather(questions, backlog())
    return asked + summarised


async def run(*, short: bool, out: TextIO = sys.stdout) -> int:
    with tempfile.TemporaryDirectory(prefix="batchpilot-llm-demo-") as work:
        repository = llm_models.write_repository(Path(work))
        out.write("Starting tritonserver (CPU) with a vLLM engine serving tiny_llm ...\n")
        with llm_models.server(repository, run_directory=Path(work) / "run") as triton:
            now = datetime.datetime.now(datetime.UTC)
            # Far enough ahead for the first apply and the lead time.
            window_opens = (now + datetime.timedelta(seconds=150 if short else 210)).replace(
                second=0, microsecond=0
            ) + datetime.timedelta(minutes=1)
            until_window = (window_opens - now).total_seconds()
            spec = documents.parse_document(policy(window_opens))
            out.write(
                f"Triton ready in {triton.startup_seconds or 0:.0f}s; log: {triton.log_path}\n"
                f"Policy: interactive {PROFILES['interactive']}; bulk {PROFILES['bulk']} "
                f"from {window_opens:%H:%M} UTC (in {until_window:.0f}s; leadTime {LEAD_TIME}: "
                "the reload starts that far ahead), when the questions "
                f"({QUESTION_RATE:g}/s) stop and "
                f"{BACKLOG} filings arrive to be summarised.\n\n"
            )
            return await _drive(triton, spec, out, until_window)


async def _drive(
    triton: local_triton.LocalTriton,
    spec: Any,
    out: TextIO,
    until_window: float,
) -> int:
    server = servers.TritonServer(triton.http_url, metrics_url=triton.metrics_url)
    runner = running.Runner(
        name="llm-demo",
        spec=spec,
        triton_servers=[server],
        source=sources.TritonMetricsSource([server], models=spec.target.models),
        metrics=telemetry.controller_metrics(),
        model_repository=triton.model_repository,
    )
    started = time.monotonic()
    view = _View(out, started)
    out.write(_View.HEADER + "\n")
    stop = asyncio.Event()
    ticking = asyncio.create_task(runner.run(interval=1.0, stop=stop, on_tick=view.tick))
    watching = asyncio.create_task(view.watch(server, stop))
    try:
        completions = await _load(triton, view, started + until_window)
        # A late reload is still shown to its end.
        for _ in range(120):
            if view.profile_at(time.monotonic() - started) == "bulk":
                break
            await asyncio.sleep(1.0)
    finally:
        stop.set()
        await ticking
        await watching
        await runner.close()
    failed = sum(not c.ok for c in completions)
    out.write(_summary(view, completions, failed) + "\n")
    return 0 if {p for _, p in view.switches} >= set(PROFILES) and not failed else 1


def _summary(view: _View, completions: list[llm_load.Completion], failed: int) -> str:
    lines = ["", "profile       requests  failed  TTFT p50 ms  TTFT p95 ms  output tokens/s"]
    for profile in PROFILES:
        mine = [c for c in completions if view.profile_at(c.sent_at - view.started) == profile]
        ttfts = [1000 * c.ttft_seconds for c in mine if c.ttft_seconds is not None]
        if not mine:
            continue
        span = max(c.finished_at for c in mine) - min(c.sent_at for c in mine)
        tokens = sum(c.tokens for c in mine) / span if span > 0 else math.nan
        lines.append(
            f"{profile:<12} {len(mine):9d} {sum(not c.ok for c in mine):7d} "
            f"{llm_load.percentile(ttfts, 0.5):12.0f} {llm_load.percentile(ttfts, 0.95):12.0f} "
            f"{tokens:16.0f}"
        )
    switches = ", ".join(f"{profile} at +{at:.0f}s" for at, profile in view.switches)
    lines += ["", f"switches: {switches}", f"failed requests: {failed} of {len(completions)}"]
    return "\n".join(lines)


def main(*, short: bool) -> int:
    for chatty in ("batchpilot.runner", "batchpilot.rollouts"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    return asyncio.run(run(short=short))
