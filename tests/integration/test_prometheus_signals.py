"""Load signals read back from a real Prometheus that scrapes a real Triton."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from prometheus_api_client import PrometheusConnect

from batchpilot.signals import prometheus
from batchpilot_harness import demo_models, loadgen, local_triton
from batchpilot_triton import engine_metrics
from fake_triton import FakeEngine, FakeModel, FakeTriton
from prometheus_fixtures import ScrapeTarget, StartPrometheus
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
async def test_prometheus_source_reads_the_fleet_rate_depth_and_latency(
    triton_server: TritonFactory, prometheus_server: StartPrometheus
) -> None:
    server = triton_server(demo_models.GPU_SIM)
    metrics = urlsplit(server.metrics_url)
    promserver = prometheus_server(
        [ScrapeTarget(address=metrics.netloc, labels={"namespace": "trading", "pod": "triton-0"})]
    )
    payload = loadgen.InferencePayload.for_input(
        model=demo_models.GPU_SIM, input_name="INPUT", datatype="FP32", shape=[1, 16]
    )
    result = await loadgen.run_load(
        base_url=server.http_url, payload=payload, phases=[loadgen.Phase(rate=200, seconds=12)]
    )
    assert result.summary().failed == 0
    source = prometheus.PrometheusSource(
        promserver.url,
        namespace="trading",
        pods=["triton-0"],
        models=[demo_models.GPU_SIM],
        window="10s",
    )
    await asyncio.sleep(1.5)  # one more scrape after the load
    reading = await source.read()
    await source.close()
    assert reading.problems == ()
    signals = reading.signals.metrics
    # The last 10 s window overlaps the load's end, so the rate is somewhere below 200.
    assert 60 < signals["requestRate"] < 260, signals
    assert signals["queueDepth"] >= 0
    assert 1 < signals["p95LatencyMs"] < 200, signals
    assert signals["queueTimeMs"] >= 0
    assert "gpuUtilization" not in signals, "no GPU here: nothing invented"

    other = prometheus.PrometheusSource(
        promserver.url, namespace="other", pods=["triton-0"], models=[demo_models.GPU_SIM]
    )
    other_reading = await other.read()
    await other.close()
    assert other_reading.signals.metrics == {}, "other namespaces' series are not ours"


@asynccontextmanager
async def steady_engine(
    *, answers_per_second: int, ttft_s: float, gap_s: float, waiting: int
) -> AsyncIterator[str]:
    """A vLLM-backed Triton's metrics page on a loopback port, its engine answering steadily
    since the page began, ten tokens an answer; yields host:port."""
    engine = FakeEngine(waiting=waiting)
    triton = FakeTriton(FakeModel("tiny_llm", engine=engine))
    started = time.monotonic()

    async def metrics(request: web.Request) -> web.Response:
        due = round(answers_per_second * (time.monotonic() - started))
        answered = engine.generation_tokens // 10
        engine.answer(requests=due - answered, ttft_s=ttft_s, tokens=10, gap_s=gap_s)
        return web.Response(text=await triton.metrics_text())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def full_window(url: str, metric: str, *, seconds: int, series: int) -> None:
    """Wait until each of `series` series of `metric` is older than `seconds`: at a 1-s scrape
    interval, `seconds + 2` samples in twice that span (a missed scrape only delays it)."""
    client = PrometheusConnect(url=url, disable_ssl=True)
    query = f"count_over_time({metric}[{2 * seconds}s]) >= {seconds + 2}"
    deadline = time.monotonic() + 30
    while len(await asyncio.to_thread(client.custom_query, query)) < series:
        assert time.monotonic() < deadline, f"Prometheus never held {seconds}s of {metric}"
        await asyncio.sleep(0.5)


@pytest.mark.timeout(60)
async def test_prometheus_source_reads_llm_engines_worst_p95s_and_summed_tokens_and_queue(
    prometheus_server: StartPrometheus,
) -> None:
    async with (
        steady_engine(answers_per_second=20, ttft_s=0.04, gap_s=0.02, waiting=1) as fast,
        steady_engine(answers_per_second=5, ttft_s=0.3, gap_s=0.07, waiting=4) as slow,
    ):
        promserver = prometheus_server(
            [
                ScrapeTarget(address=fast, labels={"namespace": "chat", "pod": "triton-0"}),
                ScrapeTarget(address=slow, labels={"namespace": "chat", "pod": "triton-1"}),
            ]
        )
        source = prometheus.PrometheusSource(
            promserver.url,
            namespace="chat",
            pods=["triton-0", "triton-1"],
            models=["tiny_llm"],
            window="5s",
        )
        wanted = {"ttftP95Ms", "interTokenP95Ms", "outputTokensPerSecond", "waitingSequences"}
        deadline = time.monotonic() + 30
        reading = await source.read()
        while not wanted <= set(reading.signals.metrics) and time.monotonic() < deadline:
            await asyncio.sleep(1)
            reading = await source.read()
        # The rate is only the engines' once Prometheus holds a whole window of their counter:
        # a series younger than the window is extrapolated only half a scrape back, and read
        # too early on a loaded machine it gave 164 tokens/s for 250.
        await full_window(promserver.url, engine_metrics.GENERATION_TOKENS, seconds=5, series=2)
        reading = await source.read()
        await source.close()
    assert reading.problems == ()
    signals = reading.signals.metrics
    # The slow replica's first tokens all fall in (250, 500] ms and its gaps in (50, 100] ms:
    # histogram_quantile puts the p95 95% into those buckets.
    assert signals["ttftP95Ms"] == pytest.approx(487.5), signals
    assert signals["interTokenP95Ms"] == pytest.approx(97.5), signals
    assert signals["outputTokensPerSecond"] == pytest.approx((20 + 5) * 10, rel=0.3), signals
    assert signals["waitingSequences"] == 5


@pytest.mark.timeout(30)
async def test_unreachable_prometheus_is_a_problem_not_a_crash() -> None:
    source = prometheus.PrometheusSource(
        "http://127.0.0.1:9", namespace="ns", pods=["p"], models=[], timeout=1
    )
    started = time.monotonic()
    reading = await source.read()
    await source.close()
    assert reading.signals.metrics == {}
    assert reading.problems
    assert "prometheus http://127.0.0.1:9" in reading.problems[0]
    assert time.monotonic() - started < 10
