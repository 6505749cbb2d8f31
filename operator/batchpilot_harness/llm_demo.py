"""`batchpilot demo --model llm`: a real vLLM engine behind Triton, from interactive to bulk.

A local tritonserver serves `tiny_llm` (a dummy-weight Llama on a real vLLM engine, on the CPU).
The policy runs `interactive` (few sequences, small prefill chunks: answers start fast) and
opens a `bulk` window (many sequences, big steps: more tokens per second) at a minute boundary,
like a market close. Analysts' questions stream in all along; when the window opens a backlog of
filings to summarise arrives. The standalone runner applies each profile by reloading the model
with a new `model.json`, under that load. One line per second shows the profile, TTFT as the
client sees it, and the engine's own tokens per second and running and waiting sequences.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from batchpilot import running, telemetry
from batchpilot.policy import documents
from batchpilot.signals import sources
from batchpilot_harness import llm_load, llm_models, local_triton
from batchpilot_triton import servers

PROFILES = {
    "interactive": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256, "chunkedPrefill": True},
    "bulk": {"maxNumSeqs": 48, "maxNumBatchedTokens": 4096, "chunkedPrefill": True},
}
QUESTION_RATE = 3.0
BACKLOG = 64
_RECENT_SECONDS = 5.0


def policy(window_opens: datetime.datetime) -> dict[str, Any]:
    closes = window_opens + datetime.timedelta(minutes=3)
    return {
        "apiVersion": documents.API_VERSION,
        "kind": documents.KIND,
        "metadata": {"name": "llm-demo"},
        "spec": {
            "target": {"selector": {}, "models": [llm_models.LLM_MODEL]},
            "profiles": {name: {"llm": llm} for name, llm in PROFILES.items()},
            "defaultProfile": "interactive",
            "schedule": {
                "timezone": "UTC",
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
    HEADER = (
        "  time   profile       questions/s  TTFT p50 ms  TTFT p95 ms  engine tok/s  running"
        "  waiting  why\n"
        "         (* = switch)  (client, last 5 s)                     (engine's own metrics)"
    )

    def __init__(self, out: TextIO, started: float) -> None:
        self.out = out
        self.started = started
        self.completions: list[llm_load.Completion] = []
        self.switches: list[tuple[float, str]] = []

    def tick(self, report: running.TickReport) -> None:
        now = time.monotonic()
        decision = report.decision
        if decision.switched:
            self.switches.append((now - self.started, decision.profile))
        recent = [c for c in self.completions if c.finished_at > now - _RECENT_SECONDS]
        ttfts = [1000 * c.ttft_seconds for c in recent if c.ttft_seconds is not None]
        rates = [r for per in report.reading.per_server.values() for r in per.values()]
        engine = next((r.engine for r in rates if r.engine is not None), None)
        tokens = engine.generation_tokens / rates[0].seconds if engine and rates else math.nan
        marker = "*" if decision.switched else " "
        reason = decision.reason if len(decision.reason) < 60 else decision.reason[:57] + "..."
        self.out.write(
            f"{now - self.started:6.0f}s {marker}{decision.profile:<12} "
            f"{len(recent) / _RECENT_SECONDS:11.1f} "
            f"{llm_load.percentile(ttfts, 0.5):12.0f} {llm_load.percentile(ttfts, 0.95):12.0f} "
            f"{tokens:13.0f} {engine.running if engine else math.nan:8.0f} "
            f"{engine.waiting if engine else math.nan:8.0f}  {reason}\n"
        )
        self.out.flush()


async def _load(
    server: local_triton.LocalTriton,
    view: _View,
    window_opens: float,
    *,
    seconds: float,
) -> list[llm_load.Completion]:
    """Questions all along; the backlog of summaries when the window opens."""

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
        seconds=seconds,
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
            triton.wait_ready(300)
            now = datetime.datetime.now(datetime.UTC)
            window_opens = (now + datetime.timedelta(seconds=30)).replace(
                second=0, microsecond=0
            ) + datetime.timedelta(minutes=1)
            until_window = (window_opens - now).total_seconds()
            seconds = until_window + (45 if short else 90)
            spec = documents.parse_document(policy(window_opens))
            out.write(
                f"Triton ready in {triton.startup_seconds or 0:.0f}s; log: {triton.log_path}\n"
                f"Policy: interactive {PROFILES['interactive']}; bulk {PROFILES['bulk']} "
                f"from {window_opens:%H:%M} UTC (in {until_window:.0f}s), when {BACKLOG} "
                f"filings arrive to be summarised. Questions: {QUESTION_RATE:g}/s.\n\n"
            )
            return await _drive(triton, spec, out, until_window, seconds)


async def _drive(
    triton: local_triton.LocalTriton,
    spec: Any,
    out: TextIO,
    until_window: float,
    seconds: float,
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
    try:
        completions = await _load(triton, view, started + until_window, seconds=seconds)
    finally:
        stop.set()
        await ticking
        await runner.close()
    failed = sum(not c.ok for c in completions)
    out.write(_summary(view, completions, failed) + "\n")
    return 0 if {p for _, p in view.switches} >= set(PROFILES) and not failed else 1


def _summary(view: _View, completions: list[llm_load.Completion], failed: int) -> str:
    def profile_at(offset: float) -> str | None:
        current = None
        for at, profile in view.switches:
            if at <= offset:
                current = profile
        return current

    lines = ["", "profile       requests  failed  TTFT p50 ms  TTFT p95 ms  output tokens/s"]
    for profile in PROFILES:
        mine = [c for c in completions if profile_at(c.sent_at - view.started) == profile]
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
