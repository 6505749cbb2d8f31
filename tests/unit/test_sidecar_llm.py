"""An LLM engine behind the sidecar: its step time fitted against its running sequences (a
sample every two seconds of readings, its running count at most the engine's max_num_seqs
where the sidecar knows it), and maxNumSeqs and maxNumBatchedTokens recommended for the
caller's objectives, on /status and to the operator's signals."""

from __future__ import annotations

import json
import logging
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from batchpilot.policy import decisions
from batchpilot.signals import sidecars
from batchpilot_sidecar import collecting, decodesteps, llm_recommending
from batchpilot_triton import modelconfigs
from builders import make_spec
from fake_triton import FakeEngine, FakeModel, FakeTriton
from sidecar_builders import (
    DECODE_TRUTH,
    Clock,
    decoded,
    make_collector,
    samples,
    serving_app,
    tick,
)

MODEL = "tiny_llm"


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def llm_report(url: str, query: str = "") -> dict[str, Any]:
    status, body = await get(f"{url}/status{query}")
    assert status == 200, body
    report: dict[str, Any] = body["models"][MODEL]["llm"]
    return report


async def decoded_engine(**load: Any) -> collecting.Collector:
    """A collector over one LLM engine that has run `decoded`'s load (its keywords)."""
    model = FakeModel(MODEL, engine=FakeEngine())
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await decoded(model, collector, clock, **load)
    return collector


async def test_status_reports_the_step_fit_and_limits_for_the_callers_objectives() -> None:
    collector = await decoded_engine()
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
    collector = await decoded_engine(running_counts=(1, 2, 3, 4))
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
    collector = await decoded_engine()
    async with serving_app(collector) as url:
        llm = await llm_report(url)
    assert llm["stepTime"]["status"] == "fitted"
    assert llm["recommendation"]["status"] == "unavailable"
    assert llm["recommendation"]["reason"] == "no objective: pass ttftP95Ms or itlP95Ms"


async def test_too_few_running_counts_say_what_is_missing_instead_of_recommending() -> None:
    collector = await decoded_engine(running_counts=(4, 8))
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
    collector = await decoded_engine()
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


async def test_metrics_export_what_the_status_shows_of_the_engine_for_its_objectives() -> None:
    collector = await decoded_engine()
    default = llm_recommending.LlmObjective(ttft_p95_ms=200, itl_p95_ms=10)
    async with serving_app(collector, default_llm_objective=default) as url:
        llm = await llm_report(url)
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
            found = samples(await response.text())
    model_label = (("model", MODEL),)

    def metric(name: str, labels: tuple[tuple[str, str], ...] = model_label) -> float:
        return found[(f"batchpilot_sidecar_{name}", labels)]

    p95 = (("model", MODEL), ("quantile", "0.95"))
    assert metric("llm_time_to_first_token_seconds", p95) == pytest.approx(llm["ttftP95Ms"] / 1000)
    assert metric("llm_inter_token_seconds", p95) == pytest.approx(llm["interTokenP95Ms"] / 1000)
    assert metric("llm_output_tokens_per_second") == llm["outputTokensPerSecond"]
    assert metric("llm_step_time_fitted") == 1
    assert metric("llm_step_time_exponent") == pytest.approx(DECODE_TRUTH.alpha, rel=1e-3)
    recommendation = llm["recommendation"]
    assert metric("recommended_max_num_seqs") == recommendation["maxNumSeqs"]["value"] == 29
    assert (
        metric("recommended_max_num_batched_tokens")
        == recommendation["maxNumBatchedTokens"]["value"]
    )
    # The batching families describe dynamic batching, which an LLM engine does not do.
    assert ("batchpilot_sidecar_recommended_queue_delay_microseconds", model_label) not in found


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
        target={"selector": {"matchLabels": {"app": "triton"}}, "models": [MODEL]},
        slo={"ttftP95Ms": 100, "itlP95Ms": 10},
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


def samples_of(collector: collecting.Collector) -> list[decodesteps.Sample]:
    return [found for _, found in collector.models[MODEL].decode_samples]


async def test_half_second_readings_make_a_sample_every_two_seconds() -> None:
    engine = FakeEngine()
    model = FakeModel(MODEL, engine=engine)
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock, interval=0.5)
    await collector.collect()
    counts = []
    for _ in range(8):
        # Half a second of 4 sequences at 10 ms a step: 200 gaps, 2 s of them.
        engine.decode(running=4, tokens=200, step_ms=10.0)
        await tick(collector, clock, 0.5)
        counts.append(len(samples_of(collector)))
    assert counts == [0, 0, 0, 1, 1, 1, 1, 2]
    assert (
        samples_of(collector)
        == [decodesteps.Sample(running=pytest.approx(4.0), tokens=800, mean_ms=pytest.approx(10.0))]
        * 2
    )


@pytest.mark.parametrize(
    ("counts_steps", "applied", "running"),
    [(False, None, 32.0), (False, {"max_num_seqs": 16}, 16.0), (True, None, 16.0)],
)
async def test_statistics_of_four_seconds_in_two_read_at_most_the_engine_s_max_num_seqs(
    counts_steps: bool, applied: dict[str, Any] | None, running: float
) -> None:
    """Late statistics: an engine that counts its steps says how many sequences each ran;
    one that does not reads as more by Little's law, up to the limit the sidecar knows."""
    engine = FakeEngine(counts_steps=counts_steps)
    model = FakeModel(MODEL, engine=engine, engine_arguments=applied)
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock, interval=0.5)
    await collector.collect()
    await tick(collector, clock, 2.0)  # the engine's statistics of these 2 s are late...
    # ...and land with the next 2 s: 16 sequences at 10 ms for 4 s, 64 s of gaps in all.
    engine.decode(running=16, tokens=6400, step_ms=10.0)
    await tick(collector, clock, 2.0)
    assert samples_of(collector) == [
        decodesteps.Sample(running=pytest.approx(running), tokens=6400, mean_ms=10.0)
    ]
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/status")
    assert status == 200
    assert body["models"][MODEL]["config"]["maxNumSeqs"] == (applied or {}).get("max_num_seqs")


async def test_a_reload_starts_the_engine_s_next_sample_afresh() -> None:
    engine = FakeEngine()
    model = FakeModel(MODEL, engine=engine)
    model.run(batch_size=1, executions=10, step_ms=1.0)  # statistics a reload resets
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock, interval=0.5)
    await collector.collect()
    for _ in range(2):
        engine.decode(running=4, tokens=200, step_ms=10.0)
        await tick(collector, clock, 0.5)
    model.reload()
    for _ in range(5):
        engine.decode(running=12, tokens=600, step_ms=10.0)
        await tick(collector, clock, 0.5)
    # Four readings after the one that saw the reload, all of the reloaded engine.
    assert samples_of(collector) == [
        decodesteps.Sample(running=pytest.approx(12.0), tokens=2400, mean_ms=pytest.approx(10.0))
    ]


def write_model_json(repository: Path, arguments: dict[str, Any]) -> Path:
    (repository / MODEL / "1").mkdir(parents=True)
    (repository / MODEL / "1" / "model.json").write_text(json.dumps(arguments))
    return repository


@pytest.mark.parametrize(
    ("in_repository", "applied", "limit"),
    [
        ({"max_num_seqs": 8}, None, 8),
        ({"max_num_seqs": 8}, {"max_num_seqs": 4}, 4),
        ({"max_num_seqs": 8}, {"max_num_batched_tokens": 512}, 8),
        (None, {"max_num_seqs": 4}, 4),
        (None, None, None),
        ({"model": "/models/tiny-llama"}, None, None),
    ],
)
async def test_the_engine_s_limit_is_batchpilot_s_arguments_over_the_repository_s_model_json(
    tmp_path: Path,
    in_repository: dict[str, Any] | None,
    applied: dict[str, Any] | None,
    limit: int | None,
) -> None:
    repository = None if in_repository is None else write_model_json(tmp_path, in_repository)
    model = FakeModel(MODEL, engine=FakeEngine(), engine_arguments=applied)
    collector = make_collector(FakeTriton(model), Clock(), model_repository=repository)
    await collector.collect()
    config = collector.models[MODEL].config
    assert config is not None
    assert config.max_num_seqs == limit


async def test_a_model_the_repository_lacks_has_no_limit_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    classic = FakeModel("classic")
    triton = FakeTriton(FakeModel(MODEL, engine=FakeEngine()), classic)
    collector = make_collector(triton, Clock(), model_repository=tmp_path)
    with caplog.at_level(logging.WARNING, logger="batchpilot.sidecar"):
        await collector.collect()
    assert [state.config.max_num_seqs for state in collector.models.values() if state.config] == [
        None,
        None,
    ]
    # Only the model served by vLLM has a model.json to look for.
    said = [record.getMessage() for record in caplog.records]
    assert [message for message in said if "engine runs" in message] == [
        f"model {MODEL}: the most sequences its engine runs are unknown: model {MODEL!r} is not "
        f"in the model repository {tmp_path}"
    ]


@pytest.mark.parametrize("value", [True, "16", 0, 2.5, None])
def test_a_max_num_seqs_that_is_no_count_of_sequences_is_no_limit(value: object) -> None:
    served = {"backend": "vllm"}
    assert modelconfigs.engine_max_num_seqs(served, {"max_num_seqs": value}) is None


def test_an_engine_arguments_parameter_batchpilot_did_not_write_leaves_the_limit_unknown() -> None:
    served = {
        "backend": "vllm",
        "parameters": {modelconfigs.ENGINE_ARGUMENTS_PARAMETER: {"string_value": "16 seqs"}},
    }
    assert modelconfigs.engine_max_num_seqs(served, {"max_num_seqs": 8}) is None
    assert modelconfigs.ServedBatching.from_model_config(served).max_num_seqs is None


def test_only_an_engine_served_by_vllm_has_a_max_num_seqs() -> None:
    assert modelconfigs.engine_max_num_seqs({"backend": "vllm"}, {"max_num_seqs": 8}) == 8
    assert modelconfigs.engine_max_num_seqs({"backend": "python"}, {"max_num_seqs": 8}) is None
