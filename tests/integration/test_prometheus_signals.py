"""Load signals read back from a real Prometheus that scrapes a real Triton."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest

from batchpilot.signals import prometheus
from batchpilot_harness import demo_models, loadgen
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
    assert (await other.read()).signals.metrics == {}, "other namespaces' series are not ours"


@pytest.mark.timeout(30)
async def test_unreachable_prometheus_is_a_problem_not_a_crash() -> None:
    source = prometheus.PrometheusSource(
        "http://127.0.0.1:9", namespace="ns", pods=["p"], models=[], timeout=1
    )
    started = time.monotonic()
    reading = await source.read()
    assert reading.signals.metrics == {}
    assert reading.problems
    assert "prometheus http://127.0.0.1:9" in reading.problems[0]
    assert time.monotonic() - started < 10
