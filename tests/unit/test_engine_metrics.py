"""An LLM engine's metrics on Triton's page: parsed, turned into window increases series by
series, and into TTFT and inter-token quantiles as PromQL's histogram_quantile gives them."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from batchpilot import reporting
from batchpilot.signals import sources
from batchpilot_triton import engine_metrics, scraping
from batchpilot_triton.engine_metrics import Histogram
from builders import make_spec
from fake_triton import FakeEngine, FakeModel, FakeTriton

BACKEND = Path(__file__).resolve().parents[2] / "manifests" / "backends" / "vllm" / "model.py"


def page(*, ttft: tuple[int, int, int], tokens: int, running: int, version: str = "1") -> str:
    """A metrics page as Triton serves the vLLM backend's: `ttft` counts in buckets up to 10 ms,
    up to 100 ms and beyond."""
    labels = f'model="tiny_llm",version="{version}"'
    first, second, third = ttft
    count = first + second + third
    return f"""# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="tiny_llm",version="{version}"}} {count}
# HELP vllm:time_to_first_token_seconds Time to first token.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{{{labels}}} {count}
vllm:time_to_first_token_seconds_sum{{{labels}}} {0.005 * first + 0.05 * second + 0.2 * third}
vllm:time_to_first_token_seconds_bucket{{{labels},le="0.01"}} {first}
vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} {first + second}
vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {count}
# HELP vllm:generation_tokens_total Output tokens generated.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{labels}}} {tokens}
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {running}
"""


def test_quantiles_interpolate_inside_a_bucket_as_prometheus_does() -> None:
    histogram = Histogram({0.01: 50.0, 0.1: 90.0, math.inf: 100.0}, 100.0, 0.0)
    assert histogram.quantile(0.5) == pytest.approx(0.01)
    assert histogram.quantile(0.7) == pytest.approx(0.01 + 0.09 * 0.5)
    # Beyond the highest finite bound: that bound.
    assert histogram.quantile(0.95) == pytest.approx(0.1)
    assert Histogram().quantile(0.5) is None


def test_a_window_counts_the_engine_s_increases_and_reads_its_gauges_at_the_end() -> None:
    before = scraping.parse(page(ttft=(10, 0, 0), tokens=100, running=0), taken_at=0.0)
    after = scraping.parse(page(ttft=(10, 20, 0), tokens=500, running=3), taken_at=10.0)
    engine = scraping.rates(before, after)["tiny_llm"].engine
    assert engine is not None
    assert engine.generation_tokens == 400
    assert engine.running == 3
    assert engine.time_to_first_token.count == 20
    # All 20 new first tokens came between 10 and 100 ms.
    assert engine.time_to_first_token.quantile(0.5) == pytest.approx(0.055)


def test_a_reloaded_engine_s_fresh_series_count_from_zero() -> None:
    before = scraping.parse(page(ttft=(10, 0, 0), tokens=400, running=2), taken_at=0.0)
    reloaded = (
        page(ttft=(10, 0, 0), tokens=400, running=0)
        + page(ttft=(0, 4, 0), tokens=50, running=1, version="2").split("\n", 3)[3]
    )  # the new version's series, without repeating the first family's header
    after = scraping.parse(reloaded, taken_at=5.0)
    engine = scraping.rates(before, after)["tiny_llm"].engine
    assert engine is not None
    assert engine.generation_tokens == 50
    assert engine.time_to_first_token.count == 4


def test_consecutive_windows_add_up_and_keep_the_later_gauges() -> None:
    one = engine_metrics.EngineCounts(generation_tokens=10, running=4, waiting=2)
    two = engine_metrics.EngineCounts(generation_tokens=5, running=1, waiting=0)
    total = engine_metrics.summed([one, None, two])
    assert total is not None
    assert (total.generation_tokens, total.running, total.waiting) == (15, 1, 0)
    assert engine_metrics.summed([None]) is None


def test_a_model_without_engine_metrics_has_none() -> None:
    text = page(ttft=(1, 0, 0), tokens=1, running=0).split("# HELP vllm:")[0]
    before = scraping.parse(text, taken_at=0.0)
    after = scraping.parse(text, taken_at=1.0)
    assert scraping.rates(before, after)["tiny_llm"].engine is None


async def test_the_triton_source_turns_an_engine_s_page_into_llm_signals() -> None:
    now = [0.0]
    replica = FakeEngine(waiting=2)
    other = FakeEngine(waiting=7)
    triton = FakeTriton(FakeModel("tiny_llm", engine=replica), FakeModel("classic"))
    second = FakeTriton(FakeModel("tiny_llm", engine=other))
    second.url = "http://triton-1.test:8000"
    source = sources.TritonMetricsSource([triton, second], models=[], clock=lambda: now[0])
    first_reading = await source.read()
    replica.answer(requests=40, ttft_s=0.08, tokens=100, gap_s=0.03)
    other.answer(requests=4, ttft_s=0.6, tokens=100, gap_s=0.2)
    now[0] = 10.0
    reading = await source.read()
    await source.close()

    assert "ttftP95Ms" not in first_reading.signals.metrics, "rates need two pages"
    metrics = reading.signals.metrics
    # Worst replica: first tokens in (0.5, 1] s and gaps in (0.1, 0.25] s, 95% into the bucket.
    assert metrics["ttftP95Ms"] == pytest.approx(975)
    assert metrics["interTokenP95Ms"] == pytest.approx(242.5)
    assert metrics["outputTokensPerSecond"] == pytest.approx((4000 + 400) / 10)
    assert metrics["waitingSequences"] == 9


async def test_a_rule_on_an_llm_figure_of_a_classic_model_finds_no_measurement() -> None:
    now = [0.0]
    source = sources.TritonMetricsSource(
        [FakeTriton(FakeModel("gpu_sim", succeeded=5))], models=[], clock=lambda: now[0]
    )
    await source.read()
    now[0] = 5.0
    metrics = (await source.read()).signals.metrics
    await source.close()
    assert metrics["requestRate"] == 0
    spec = make_spec(load={"rules": [{"profile": "bulk", "metric": "ttftP95Ms", "above": 500}]})
    assert reporting.missing_signals(spec, metrics) == ["no ttftP95Ms measurement"]


def test_the_test_world_backend_exports_the_names_the_sidecar_reads() -> None:
    exported = {
        node.value
        for node in ast.walk(ast.parse(BACKEND.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("vllm:")
    }
    read = {*engine_metrics.HISTOGRAMS, *engine_metrics.COUNTERS, *engine_metrics.GAUGES}
    assert exported == read
