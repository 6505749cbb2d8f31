"""Triton metrics pages into rates and load signals."""

from __future__ import annotations

import pytest

from batchpilot.signals import aggregating
from batchpilot_triton import reports, scraping


def page(
    *,
    success: int,
    failure: int = 0,
    count: int,
    execs: int,
    queue_us: int,
    request_us: int,
    pending: int,
    p95_us: float | None = None,
    model: str = "gpu_sim",
    busy: float = 0.0,
) -> str:
    lines = [
        "# TYPE nv_inference_request_success counter",
        f'nv_inference_request_success{{model="{model}",version="1"}} {success}',
        "# TYPE nv_inference_request_failure counter",
        f'nv_inference_request_failure{{model="{model}",reason="REJECTED",version="1"}} {failure}',
        f'nv_inference_request_failure{{model="{model}",reason="OTHER",version="1"}} 0',
        "# TYPE nv_inference_count counter",
        f'nv_inference_count{{model="{model}",version="1"}} {count}',
        "# TYPE nv_inference_exec_count counter",
        f'nv_inference_exec_count{{model="{model}",version="1"}} {execs}',
        "# TYPE nv_inference_request_duration_us counter",
        f'nv_inference_request_duration_us{{model="{model}",version="1"}} {request_us}',
        "# TYPE nv_inference_queue_duration_us counter",
        f'nv_inference_queue_duration_us{{model="{model}",version="1"}} {queue_us}',
        "# TYPE nv_inference_pending_request_count gauge",
        f'nv_inference_pending_request_count{{model="{model}",version="1"}} {pending}',
        "# TYPE emulated_device_busy_seconds_total counter",
        f'emulated_device_busy_seconds_total{{model="{model}",version="1"}} {busy}',
    ]
    if p95_us is not None:
        lines += [
            "# TYPE nv_inference_request_summary_us summary",
            f'nv_inference_request_summary_us_count{{model="{model}",version="1"}} {success}',
            f'nv_inference_request_summary_us_sum{{model="{model}",version="1"}} {request_us}',
            f'nv_inference_request_summary_us{{model="{model}",version="1",quantile="0.95"}} '
            f"{p95_us}",
            f'nv_inference_request_summary_us{{model="{model}",version="1",quantile="0.5"}} NaN',
        ]
    return "\n".join(lines) + "\n"


def test_rates_between_two_pages() -> None:
    before = scraping.parse(
        page(
            success=100, count=400, execs=100, queue_us=1000, request_us=50_000, pending=0, busy=1.0
        ),
        taken_at=10.0,
    )
    after = scraping.parse(
        page(
            success=300,
            failure=2,
            count=1200,
            execs=150,
            queue_us=203_000,
            request_us=2_050_000,
            pending=7,
            p95_us=31_000,
            busy=1.5,
        ),
        taken_at=12.0,
    )
    rates = scraping.rates(before, after)["gpu_sim"]
    assert rates.request_rate == pytest.approx(101.0)
    assert rates.counted.requests_failed == 2
    assert rates.counted.average_batch_size == pytest.approx(16.0)
    assert rates.counted.queue_ms_per_request == pytest.approx(1.0)
    assert rates.counted.latency_ms_per_request == pytest.approx(2000 / 202)
    assert rates.counted.device_busy_seconds == pytest.approx(0.5)
    assert rates.pending == 7
    assert rates.p95_ms == pytest.approx(31.0)
    assert rates.p50_ms is None  # NaN in an empty summary window is no value
    assert after.summaries_enabled
    assert not before.summaries_enabled


def test_counter_reset_after_a_restart_counts_from_zero() -> None:
    before = scraping.parse(
        page(success=5000, count=5000, execs=500, queue_us=1, request_us=1, pending=0), taken_at=0.0
    )
    after = scraping.parse(
        page(success=40, count=80, execs=10, queue_us=1, request_us=1, pending=0), taken_at=4.0
    )
    assert scraping.rates(before, after)["gpu_sim"].request_rate == pytest.approx(10.0)


def test_signals_sum_rates_and_depth_and_take_the_worst_p95() -> None:
    one = scraping.rates(
        scraping.parse(
            page(success=0, count=0, execs=0, queue_us=0, request_us=0, pending=0), taken_at=0
        ),
        scraping.parse(
            page(
                success=100,
                count=100,
                execs=10,
                queue_us=100_000,
                request_us=1,
                pending=3,
                p95_us=20_000,
            ),
            taken_at=1,
        ),
    )
    two = scraping.rates(
        scraping.parse(
            page(success=0, count=0, execs=0, queue_us=0, request_us=0, pending=0), taken_at=0
        ),
        scraping.parse(
            page(
                success=300,
                count=300,
                execs=10,
                queue_us=500_000,
                request_us=1,
                pending=5,
                p95_us=45_000,
            ),
            taken_at=1,
        ),
    )
    signals = aggregating.signals_from_rates(
        [one, two], models=["gpu_sim"], gpu_utilization=[0.5, 0.7]
    )
    assert signals.metrics == pytest.approx(
        {
            "queueDepth": 8,
            "requestRate": 400,
            "queueTimeMs": 1.5,
            "p95LatencyMs": 45.0,
            "gpuUtilization": 60.0,
        }
    )
    assert aggregating.signals_from_rates([one], models=["other"]).metrics == {}


def engine_report(
    *, ttft_p95: float | None, gap_p95: float | None, tokens: float, waiting: float
) -> reports.LlmReport:
    return reports.LlmReport(
        ttft_p50_ms=None,
        ttft_p95_ms=ttft_p95,
        inter_token_p50_ms=None,
        inter_token_p95_ms=gap_p95,
        first_tokens=0,
        output_tokens_per_second=tokens,
        prompt_tokens_per_second=0,
        running_sequences=0,
        waiting_sequences=waiting,
        kv_cache_usage=None,
    )


def test_llm_signals_take_the_worst_replica_s_p95s_and_sum_tokens_and_waiting() -> None:
    first_server = {
        "tiny_llm": engine_report(ttft_p95=120, gap_p95=30, tokens=900, waiting=3),
        "other_llm": engine_report(ttft_p95=9000, gap_p95=900, tokens=5, waiting=50),
    }
    # A replica that produced no first token in the window has no TTFT to compare.
    second_server = {"tiny_llm": engine_report(ttft_p95=None, gap_p95=45, tokens=600, waiting=4)}
    signals = aggregating.signals_from_rates(
        [], models=["tiny_llm"], engines=[first_server, second_server]
    )
    assert signals.metrics == pytest.approx(
        {
            "ttftP95Ms": 120,
            "interTokenP95Ms": 45,
            "outputTokensPerSecond": 1500,
            "waitingSequences": 7,
        }
    )
    everything = aggregating.signals_from_rates([], models=[], engines=[first_server]).metrics
    assert (everything["ttftP95Ms"], everything["waitingSequences"]) == (9000, 53)


def test_without_an_llm_engine_there_are_no_llm_signals() -> None:
    idle = engine_report(ttft_p95=None, gap_p95=None, tokens=0, waiting=0)
    quiet = aggregating.signals_from_rates([], models=[], engines=[{"tiny_llm": idle}]).metrics
    assert quiet == {"outputTokensPerSecond": 0, "waitingSequences": 0}
    assert aggregating.signals_from_rates([], models=[], engines=[{}, {}]).metrics == {}
    assert (
        aggregating.signals_from_rates([], models=["x"], engines=[{"tiny_llm": idle}]).metrics == {}
    )
