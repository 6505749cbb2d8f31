"""Load signals from sidecars: real sidecar documents aggregated like Triton's own pages."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from batchpilot.policy import decisions
from batchpilot.signals import sidecars
from batchpilot_harness import local_triton
from builders import make_spec
from fake_triton import FakeEngine, FakeModel, FakeTriton
from sidecar_builders import Clock, fitted, make_collector, serving_app, tick

SLO = {"p95LatencyMs": 40, "autotune": True, "maxQueueDelayMicroseconds": 30_000}


async def test_signals_add_up_over_sidecars_and_the_smallest_recommendation_wins() -> None:
    busy = FakeModel("gpu_sim", pending=7, quantiles_us={0.95: 31_000})
    quiet = FakeModel("gpu_sim", pending=2, quantiles_us={0.95: 12_000})
    first_clock, second_clock = Clock(), Clock()
    first = make_collector(FakeTriton(busy, FakeModel("other")), first_clock, rate_window=5.0)
    second = make_collector(FakeTriton(quiet), second_clock, rate_window=5.0)
    await fitted(busy, first, first_clock, requests=2000)
    await fitted(quiet, second, second_clock, requests=100)
    spec = make_spec(
        target={"selector": {"matchLabels": {"app": "triton"}}, "models": ["gpu_sim"]}, slo=SLO
    )
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving_app(c)) for c in (first, second)]
        source = sidecars.SidecarSource(urls, models=spec.target.models, slo=spec.slo)
        reading = await source.read()
        await source.close()
        alone = sidecars.SidecarSource(urls[1:], models=["gpu_sim"], slo=spec.slo)
        quiet_only = (await alone.read()).signals.metrics
        await alone.close()

    metrics = reading.signals.metrics
    assert reading.problems == ()
    assert metrics["queueDepth"] == 9
    assert metrics["requestRate"] == pytest.approx(400 + 20, rel=0.01)
    assert metrics["p95LatencyMs"] == 31
    assert "gpuUtilization" not in metrics, "no GPU, no number"
    assert "waitingSequences" not in metrics, "no LLM engine, no engine figures"
    # More load makes bigger batches and leaves less room for waiting.
    assert (
        metrics[decisions.RECOMMENDED_QUEUE_DELAY] < quiet_only[decisions.RECOMMENDED_QUEUE_DELAY]
    )
    assert set(reading.per_server) == set(urls)
    assert "other" in reading.per_server[urls[0]], "per-server details keep every model"


async def test_llm_engine_figures_of_the_governed_models_become_signals() -> None:
    fast, slow, ungoverned = FakeEngine(waiting=1), FakeEngine(waiting=4), FakeEngine(waiting=50)
    first_clock, second_clock = Clock(), Clock()
    first = make_collector(
        FakeTriton(FakeModel("tiny_llm", engine=fast), FakeModel("other_llm", engine=ungoverned)),
        first_clock,
        rate_window=5.0,
    )
    second = make_collector(
        FakeTriton(FakeModel("tiny_llm", engine=slow)), second_clock, rate_window=5.0
    )
    await first.collect()
    await second.collect()
    fast.answer(requests=20, ttft_s=0.04, tokens=50, gap_s=0.02)
    slow.answer(requests=10, ttft_s=0.3, tokens=50, gap_s=0.07)
    ungoverned.answer(requests=10, ttft_s=2.0, tokens=10, gap_s=2.0)
    await tick(first, first_clock, 5.0)
    await tick(second, second_clock, 5.0)
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving_app(c)) for c in (first, second)]
        source = sidecars.SidecarSource(urls, models=["tiny_llm"], slo=None)
        reading = await source.read()
        await source.close()

    assert reading.problems == ()
    metrics = reading.signals.metrics
    # The slow replica's first tokens came in (250, 500] ms, its gaps in (50, 100] ms: the
    # p95 interpolates 95% into those buckets, as histogram_quantile does.
    assert metrics["ttftP95Ms"] == pytest.approx(487.5)
    assert metrics["interTokenP95Ms"] == pytest.approx(97.5)
    assert metrics["outputTokensPerSecond"] == pytest.approx((1000 + 500) / 5)
    assert metrics["waitingSequences"] == 5


async def test_without_an_objective_there_is_no_recommendation_signal() -> None:
    clock = Clock()
    model = FakeModel("gpu_sim")
    collector = make_collector(FakeTriton(model), clock)
    await fitted(model, collector, clock)
    async with serving_app(collector) as url:
        source = sidecars.SidecarSource([url], models=[], slo=None)
        reading = await source.read()
        await source.close()
    assert decisions.RECOMMENDED_QUEUE_DELAY not in reading.signals.metrics
    assert reading.signals.metrics["requestRate"] > 0


async def test_estimated_latencies_are_not_signals() -> None:
    clock = Clock()
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    triton.summaries = False
    collector = make_collector(triton, clock)
    await fitted(model, collector, clock)
    async with serving_app(collector) as url:
        source = sidecars.SidecarSource([url], models=[], slo=None)
        reading = await source.read()
        await source.close()
    assert "p95LatencyMs" not in reading.signals.metrics
    assert "queueTimeMs" in reading.signals.metrics


async def test_an_unreachable_or_stale_sidecar_is_a_problem_and_contributes_nothing() -> None:
    clock = Clock()
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    collector = make_collector(triton, clock)
    await fitted(model, collector, clock)
    (dead_port,) = local_triton.free_ports("127.0.0.1", 1)
    dead = f"http://127.0.0.1:{dead_port}"
    async with serving_app(collector) as url:
        source = sidecars.SidecarSource([dead, url], models=[], slo=None, timeout=1)
        reading = await source.read()
        triton.down = True
        for _ in range(4):
            await tick(collector, clock)
        stale = await source.read()
        await source.close()
    (problem,) = reading.problems
    assert problem.startswith(f"sidecar {dead}: ")
    assert list(reading.per_server) == [url]
    assert reading.signals.metrics["requestRate"] > 0
    assert len(stale.problems) == 2
    assert "stale" in stale.problems[1]
    assert stale.signals.metrics == {}
