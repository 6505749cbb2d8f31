"""An LLM engine behind the sidecar: its step time fitted against its running sequences, and
maxNumSeqs and maxNumBatchedTokens recommended for the caller's objectives, on /status and to
the operator's signals."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from batchpilot.policy import decisions
from batchpilot.signals import sidecars
from batchpilot_sidecar import llm_recommending
from builders import make_spec
from fake_triton import FakeEngine, FakeModel, FakeTriton
from sidecar_builders import DECODE_TRUTH, Clock, decoded, make_collector, serving_app

MODEL = "tiny_llm"


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def llm_report(url: str, query: str = "") -> dict[str, Any]:
    status, body = await get(f"{url}/status{query}")
    assert status == 200, body
    report: dict[str, Any] = body["models"][MODEL]["llm"]
    return report


async def test_status_reports_the_step_fit_and_limits_for_the_callers_objectives() -> None:
    model = FakeModel(MODEL, engine=FakeEngine())
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await decoded(model, collector, clock)
    async with serving_app(collector) as url:
        llm = await llm_report(url, "?ttftP95Ms=200&itlP95Ms=10")

    fit = llm["stepTime"]
    assert fit["status"] == "fitted"
    assert fit["batchSizes"] == [1, 2, 4, 8, 16]
    assert fit["t0Ms"] == pytest.approx(DECODE_TRUTH.t0_ms, rel=1e-3)
    assert fit["cMs"] == pytest.approx(DECODE_TRUTH.c_ms, rel=1e-3)
    assert fit["alpha"] == pytest.approx(DECODE_TRUTH.alpha, rel=1e-3)
    recommendation = llm["recommendation"]
    assert recommendation["status"] == "ok"
    assert recommendation["objective"] == {
        "ttftP95Ms": 200.0,
        "itlP95Ms": 10.0,
        "marginFraction": 0.1,
    }
    # 29 sequences step in 8.92 ms, within 10 ms less the margin, but the fit saw 16 at most.
    seqs = recommendation["maxNumSeqs"]
    assert (seqs["status"], seqs["value"], seqs["meetsObjective"]) == ("ok", 29, True)
    assert recommendation["assumedRunningSequences"] == 29
    assert recommendation["meanPromptTokens"] == 256
    expected = llm_recommending.max_num_batched_tokens(
        DECODE_TRUTH,
        ttft_p95_ms=200,
        running=29,
        prompt_tokens=256,
        prompt_tokens_per_second=recommendation["promptTokensPerSecond"],
    )
    tokens = recommendation["maxNumBatchedTokens"]
    assert tokens["value"] == expected.value
    assert tokens["value"] >= seqs["value"]
    assert tokens["reason"] == expected.reason


async def test_the_recommendation_extrapolates_no_further_than_twice_what_was_measured() -> None:
    model = FakeModel(MODEL, engine=FakeEngine())
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await decoded(model, collector, clock, running_counts=(1, 2, 3, 4))
    async with serving_app(collector) as url:
        llm = await llm_report(url, "?itlP95Ms=10")
    recommendation = llm["recommendation"]
    assert recommendation["maxNumSeqs"]["value"] == 8
    assert recommendation["maxNumBatchedTokens"] == {
        "status": "unavailable",
        "reason": "no ttftP95Ms objective",
        "value": None,
        "stepMs": None,
        "marginMs": None,
        "meetsObjective": None,
    }


async def test_without_an_objective_the_fit_is_shown_and_the_limits_are_not() -> None:
    model = FakeModel(MODEL, engine=FakeEngine())
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await decoded(model, collector, clock)
    async with serving_app(collector) as url:
        llm = await llm_report(url)
    assert llm["stepTime"]["status"] == "fitted"
    assert llm["recommendation"]["status"] == "unavailable"
    assert llm["recommendation"]["reason"] == "no objective: pass ttftP95Ms or itlP95Ms"


async def test_too_few_running_counts_say_what_is_missing_instead_of_recommending() -> None:
    model = FakeModel(MODEL, engine=FakeEngine())
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await decoded(model, collector, clock, running_counts=(4, 8))
    async with serving_app(collector) as url:
        llm = await llm_report(url, "?itlP95Ms=10")
    assert llm["stepTime"]["status"] == "insufficient"
    assert llm["stepTime"]["batchSizes"] == [4, 8]
    assert llm["recommendation"]["status"] == "unavailable"
    assert llm["recommendation"]["reason"] == (
        "step time not fitted: 2 distinct running-sequence counts seen at least 16 times "
        "(4, 8); a fit needs 4 spanning at least 4x"
    )
    assert llm["recommendation"]["objective"]["itlP95Ms"] == 10


async def test_the_sidecars_own_llm_objectives_are_the_default_and_the_query_overrides() -> None:
    model = FakeModel(MODEL, engine=FakeEngine())
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await decoded(model, collector, clock)
    default = llm_recommending.LlmObjective(ttft_p95_ms=300, itl_p95_ms=8)
    async with serving_app(collector, default_llm_objective=default) as url:
        by_default = await llm_report(url)
        asked = await llm_report(url, "?itlP95Ms=12")
    assert by_default["recommendation"]["objective"]["itlP95Ms"] == 8
    assert asked["recommendation"]["objective"] == {
        "ttftP95Ms": 300.0,
        "itlP95Ms": 12.0,
        "marginFraction": 0.1,
    }
    assert (
        asked["recommendation"]["maxNumSeqs"]["value"]
        > (by_default["recommendation"]["maxNumSeqs"]["value"])
    )


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("itlP95Ms=0", "itlP95Ms must be a positive number of ms, not 0"),
        ("ttftP95Ms=soon", "ttftP95Ms='soon' is not a number"),
    ],
)
async def test_a_nonsensical_llm_objective_is_a_bad_request(query: str, error: str) -> None:
    collector = make_collector(FakeTriton(FakeModel(MODEL, engine=FakeEngine())), Clock())
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/status?{query}")
    assert status == 400
    assert error in body["error"]


def test_the_policy_s_llm_objectives_go_to_the_sidecar_without_the_queue_delay_bounds() -> None:
    spec = make_spec(slo={"ttftP95Ms": 500, "itlP95Ms": 40})
    assert sidecars.objective_query(spec.slo) == {"ttftP95Ms": "500", "itlP95Ms": "40"}
    both = make_spec(slo={"p95LatencyMs": 50, "itlP95Ms": 40})
    assert sidecars.objective_query(both.slo) == {
        "sloP95Ms": "50",
        "minDelayUs": "0",
        "maxDelayUs": "100000",
        "itlP95Ms": "40",
    }


async def test_signals_carry_the_fewest_sequences_and_the_most_tokens_over_sidecars() -> None:
    tight, loose = FakeModel(MODEL, engine=FakeEngine()), FakeModel(MODEL, engine=FakeEngine())
    first_clock, second_clock = Clock(), Clock()
    first = make_collector(FakeTriton(tight), first_clock)
    second = make_collector(FakeTriton(loose), second_clock)
    await decoded(tight, first, first_clock, prompt_tokens=2048)
    await decoded(loose, second, second_clock, running_counts=(1, 2, 3, 4), prompt_tokens=64)
    spec = make_spec(
        target={"selector": {}, "models": [MODEL]}, slo={"ttftP95Ms": 100, "itlP95Ms": 10}
    )
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving_app(c)) for c in (first, second)]
        source = sidecars.SidecarSource(urls, models=spec.target.models, slo=spec.slo)
        reading = await source.read()
        await source.close()
        reports = [await llm_report(url, "?ttftP95Ms=100&itlP95Ms=10") for url in urls]
    limits = [r["recommendation"] for r in reports]
    seqs = [limit["maxNumSeqs"]["value"] for limit in limits]
    tokens = [limit["maxNumBatchedTokens"]["value"] for limit in limits]
    assert seqs == [29, 8]
    assert tokens[0] > tokens[1]
    metrics = reading.signals.metrics
    assert metrics[decisions.RECOMMENDED_MAX_NUM_SEQS] == 8
    assert metrics[decisions.RECOMMENDED_MAX_NUM_BATCHED_TOKENS] == tokens[0]
    assert decisions.RECOMMENDED_QUEUE_DELAY not in metrics
