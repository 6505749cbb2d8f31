"""The sidecar over HTTP: /status's document and objective, /metrics, /healthz, its docs page."""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yarl

from batchpilot import cli
from batchpilot_sidecar import advising, collecting, recommending, serving, telemetry
from batchpilot_triton import repositories
from fake_nvml import GIB, FakeGpu
from fake_triton import FakeModel, FakeTriton
from sidecar_builders import (
    TRUTH,
    Clock,
    fitted,
    make_collector,
    one_gpu,
    samples,
    serving_app,
    tick,
)

REPO = Path(__file__).resolve().parents[2]


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def test_status_reports_rates_fit_and_a_recommendation_for_the_callers_objective() -> None:
    model = FakeModel("gpu_sim")
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock, rate_window=5.0)
    await fitted(model, collector, clock, requests=1000)
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/status?sloP95Ms=40&marginMs=5&maxDelayUs=30000")

    assert status == 200
    assert set(body) == {"sidecar", "fresh", "sources", "gpu", "objective", "models"}
    assert body["fresh"] is True
    assert body["sources"]["tritonMetrics"]["stale"] is False
    assert body["gpu"]["status"] == "unavailable"
    assert "nvidia-ml-py" in body["gpu"]["reason"]
    assert body["gpu"]["devices"] == []
    assert body["objective"] == {
        "sloP95Ms": 40.0,
        "marginMs": 5.0,
        "minDelayUs": 0,
        "maxDelayUs": 30000,
    }
    served = body["models"]["gpu_sim"]
    assert served["requestRate"] == 200
    assert served["inferenceRate"] == 200
    assert served["averageBatchSize"] == 4
    assert served["queueMsPerRequest"] == 3
    assert served["computeMsPerExecution"] == pytest.approx(TRUTH.ms(4), abs=1e-4)
    assert served["window"]["seconds"] == 5
    assert served["window"]["requestsSucceeded"] == 1000
    step = served["stepTime"]
    assert step["status"] == "fitted"
    assert step["t0Ms"] == pytest.approx(4.0, rel=0.01)
    assert step["cMs"] == pytest.approx(0.35, rel=0.01)
    assert step["alpha"] == pytest.approx(0.7, rel=0.01)
    assert step["rSquared"] > 0.999
    assert step["batchSizes"] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert step["upToDate"] is True
    assert [point["batchSize"] for point in step["points"]] == step["batchSizes"]
    recommendation = served["recommendation"]
    assert recommendation["status"] == "ok"
    assert recommendation["preferredBatchSize"] == 32
    assert recommendation["memoryCapBatchSize"] is None
    assert "batchpilot.dev/memory-per-item-bytes" in recommendation["memoryCapReason"]
    delay = recommendation["queueDelay"]
    assert delay["status"] == "ok"
    assert delay["meetsObjective"] is True
    # The delay spends the objective: delay + step of the batch it makes + margin = 40 ms.
    assert delay["microseconds"] / 1000 + delay["stepMs"] + 5 == pytest.approx(40, abs=0.01)


async def test_without_an_objective_there_is_no_delay_but_still_a_preferred_batch() -> None:
    model = FakeModel("gpu_sim")
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await fitted(model, collector, clock)
    async with serving_app(collector) as url:
        _, body = await get(f"{url}/status")
    assert body["objective"] is None
    recommendation = body["models"]["gpu_sim"]["recommendation"]
    assert recommendation["preferredBatchSize"] == 32
    assert recommendation["queueDelay"]["status"] == "unavailable"
    assert "pass sloP95Ms" in recommendation["queueDelay"]["reason"]


async def test_the_sidecars_own_objective_is_the_default_and_the_query_overrides_it() -> None:
    model = FakeModel("gpu_sim")
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await fitted(model, collector, clock)
    default = recommending.Objective(p95_ms=30, max_delay_us=10_000)
    async with serving_app(collector, default_objective=default) as url:
        _, by_default = await get(f"{url}/status")
        _, asked = await get(f"{url}/status?sloP95Ms=60")
    assert by_default["objective"]["sloP95Ms"] == 30
    assert asked["objective"] == {
        "sloP95Ms": 60.0,
        "marginMs": 6.0,
        "minDelayUs": 0,
        "maxDelayUs": 10000,
    }


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("sloP95Ms=fast", "sloP95Ms='fast' is not a number"),
        ("sloP95Ms=-3", "must be positive"),
        ("sloP95Ms=50&minDelayUs=900&maxDelayUs=100", "delay bounds"),
        ("marginMs=2", "need sloP95Ms"),
        ("sloP95Ms=inf", "not a finite number"),
    ],
)
async def test_a_nonsensical_objective_is_a_bad_request(query: str, error: str) -> None:
    collector = make_collector(FakeTriton(FakeModel("gpu_sim")), Clock())
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/status?{query}")
    assert status == 400
    assert error in body["error"]


async def test_before_enough_batch_sizes_the_status_says_what_is_missing() -> None:
    model = FakeModel("gpu_sim")
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock)
    await collector.collect()
    model.run(batch_size=1, executions=20, step_ms=4.4)
    await tick(collector, clock)
    async with serving_app(collector) as url:
        _, body = await get(f"{url}/status?sloP95Ms=40")
    served = body["models"]["gpu_sim"]
    assert served["stepTime"]["status"] == "insufficient"
    assert served["stepTime"]["batchSizes"] == [1]
    recommendation = served["recommendation"]
    assert recommendation["status"] == "unavailable"
    assert recommendation["reason"] == "step time not fitted: " + served["stepTime"]["reason"]
    assert recommendation["queueDelay"] is None, "fields that do not apply are null"


async def test_latency_quantiles_are_triton_summaries_or_say_they_are_estimated() -> None:
    model = FakeModel("gpu_sim", quantiles_us={0.5: 9_000, 0.95: 21_000, 0.99: 30_000})
    triton = FakeTriton(model)
    clock = Clock()
    collector = make_collector(triton, clock)
    await collector.collect()
    model.run(batch_size=4, executions=25, step_ms=5.0, queue_ms=8.0)
    await tick(collector, clock)
    async with serving_app(collector) as url:
        _, measured = await get(f"{url}/status")
        triton.summaries = False
        await tick(collector, clock)
        model.run(batch_size=4, executions=25, step_ms=5.0, queue_ms=8.0)
        await tick(collector, clock)
        _, estimated = await get(f"{url}/status")
    assert measured["models"]["gpu_sim"]["latencyMs"] == {
        "p50": 9.0,
        "p95": 21.0,
        "p99": 30.0,
        "source": "summary",
        "method": "Triton's summary metrics (nv_inference_request_summary_us)",
    }
    latency = estimated["models"]["gpu_sim"]["latencyMs"]
    assert latency["source"] == "estimated"
    assert "summary_latencies=true" in latency["method"]
    # Mean request 13 ms of which 8 ms queued: the wait is taken as uniform over [0, 16] ms.
    assert (latency["p50"], latency["p95"], latency["p99"]) == pytest.approx((13, 20.2, 20.84))


def test_no_requests_means_no_latency_at_all() -> None:
    assert advising.latency(None, summaries_enabled=True).quantiles_ms == {}


async def test_the_memory_cap_needs_a_declared_size_per_item_and_a_gpu_that_reports_memory() -> (
    None
):
    model = FakeModel("gpu_sim", memory_per_item_bytes=2 * 1024**2)
    clock = Clock()
    gpu = FakeGpu(memory_used=24 * GIB - 100 * 1024**2)  # 100 MiB free
    collector = make_collector(FakeTriton(model), clock, monitor=one_gpu(gpu))
    await fitted(model, collector, clock)
    async with serving_app(collector) as url:
        _, body = await get(f"{url}/status")
    recommendation = body["models"]["gpu_sim"]["recommendation"]
    assert recommendation["memoryCapBatchSize"] == 45  # 90% of 100 MiB at 2 MiB per item
    assert recommendation["preferredBatchSize"] == 32
    assert body["gpu"]["status"] == "available"
    assert body["gpu"]["devices"][0]["memoryFreeBytes"] == 100 * 1024**2


async def test_stale_readings_are_flagged() -> None:
    triton = FakeTriton(FakeModel("gpu_sim"))
    clock = Clock()
    collector = make_collector(triton, clock)
    await collector.collect()
    triton.down = True
    for _ in range(4):
        await tick(collector, clock)
    async with serving_app(collector) as url:
        _, body = await get(f"{url}/status")
    assert body["fresh"] is False
    metrics = body["sources"]["tritonMetrics"]
    assert metrics["stale"] is True
    assert metrics["ageSeconds"] == 4
    assert "Connection refused" in metrics["error"]
    assert metrics["failures"] == 4


async def test_metrics_export_the_measurements_and_nothing_unmeasured() -> None:
    model = FakeModel("gpu_sim")
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock, rate_window=5.0)
    await fitted(model, collector, clock, requests=1000)
    objective = recommending.Objective(p95_ms=40)
    async with serving_app(collector, default_objective=objective) as url:
        status, text = await get(f"{url}/metrics")
    assert status == 200
    found = samples(text)
    model_label = (("model", "gpu_sim"),)
    assert found[("batchpilot_sidecar_requests_per_second", model_label)] == 200
    assert found[("batchpilot_sidecar_average_batch_size", model_label)] == 4
    assert found[("batchpilot_sidecar_step_time_fitted", model_label)] == 1
    assert found[("batchpilot_sidecar_step_time_exponent", model_label)] == pytest.approx(
        0.7, rel=0.01
    )
    assert found[("batchpilot_sidecar_step_time_base_seconds", model_label)] == pytest.approx(
        0.004, rel=0.01
    )
    assert found[("batchpilot_sidecar_recommended_batch_size", model_label)] == 32
    assert found[("batchpilot_sidecar_recommended_queue_delay_microseconds", model_label)] > 0
    assert found[("batchpilot_sidecar_gpu_available", ())] == 0
    assert found[("batchpilot_sidecar_models_tracked", ())] == 1
    assert found[("batchpilot_sidecar_source_up", (("source", "triton_metrics"),))] == 1
    names = {name for name, _ in found}
    assert not any(name.startswith("batchpilot_sidecar_gpu_memory") for name in names)
    assert "batchpilot_sidecar_memory_batch_cap" not in names
    assert not any(name.startswith("batchpilot_sidecar_llm_") for name in names), "no engine"
    assert all(name.startswith("batchpilot_sidecar_") for name in names)


async def test_metrics_export_every_gpu() -> None:
    clock = Clock()
    collector = make_collector(FakeTriton(FakeModel("gpu_sim")), clock, monitor=one_gpu())
    await collector.collect()
    async with serving_app(collector) as url:
        _, text = await get(f"{url}/metrics")
    found = samples(text)
    gpu = (("gpu", "0"), ("uuid", "GPU-0000"))
    assert found[("batchpilot_sidecar_gpu_available", ())] == 1
    assert found[("batchpilot_sidecar_gpu_utilization_ratio", gpu)] == 0.37
    assert found[("batchpilot_sidecar_gpu_power_watts", gpu)] == 41.5
    assert found[("batchpilot_sidecar_gpu_sm_clock_hertz", gpu)] == 2.04e9
    assert found[("batchpilot_sidecar_gpu_memory_total_bytes", gpu)] == 24 * GIB


async def test_healthz_reflects_the_collection_loop_not_triton() -> None:
    triton = FakeTriton(FakeModel("gpu_sim"))
    clock = Clock()
    collector = make_collector(triton, clock)
    await collector.collect()
    triton.down = True
    await tick(collector, clock)
    async with serving_app(collector) as url:
        healthy = await get(f"{url}/healthz")
        clock.now += 60
        stalled = await get(f"{url}/healthz")
    assert healthy == (200, "ok\n")
    assert stalled[0] == 503


def test_the_sidecar_endpoints_page_documents_every_metric() -> None:
    page = (REPO / "docs" / "reference" / "sidecar-endpoints.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`(batchpilot_sidecar_[a-z_]+)`", page))
    exported = {telemetry.exported_name(family) for family in telemetry.FAMILIES.values()}
    assert documented == exported


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--listen", "9400"], "expected HOST:PORT"),
        (["--interval", "0"], "interval must be positive"),
        (["--slo-p95-ms", "-5"], "must be positive"),
        (["--model-repository", "/nonexistent/models"], "is not a directory"),
    ],
)
def test_the_command_refuses_what_cannot_work(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["sidecar", "--triton-url", "http://127.0.0.1:1", *arguments])
    assert status == 2
    assert message in capsys.readouterr().err


async def test_a_port_in_use_is_an_error_not_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            await serving.run_sidecar(
                triton_url="http://127.0.0.1:1",
                metrics_url=None,
                listen=("127.0.0.1", port),
                settings=collecting.Settings(),
            )


def llm_repository(root: Path) -> Path:
    """A repository with an LLM model (versions 1 and 2), a classic model, and a model.json
    just outside it."""
    repository = root / "models"
    for version, seqs in (("1", 8), ("2", 16)):
        (repository / "tiny_llm" / version).mkdir(parents=True)
        (repository / "tiny_llm" / version / "model.json").write_text(
            json.dumps({"model": "/models/tiny-llama", "max_num_seqs": seqs})
        )
    (repository / "classic" / "1").mkdir(parents=True)
    (root / "model.json").write_text('{"secret": true}')
    return repository


async def get_raw(url: str) -> tuple[int, Any]:
    """GET a URL exactly as written: no client-side normalization of dots or escapes."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(yarl.URL(url, encoded=True)) as response,
    ):
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def test_the_engine_arguments_are_the_newest_versions_model_json(tmp_path: Path) -> None:
    collector = make_collector(FakeTriton(), Clock(), model_repository=llm_repository(tmp_path))
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/v1/models/tiny_llm/engine-arguments")
    assert status == 200
    assert body == {
        "model": "tiny_llm",
        "version": "2",
        "arguments": {"model": "/models/tiny-llama", "max_num_seqs": 16},
    }


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ("absent", "'absent' is not in the model repository"),
        ("classic", "model 'classic' has no model.json in a version directory"),
    ],
)
async def test_a_model_without_engine_arguments_is_not_found_with_the_reason(
    tmp_path: Path, model: str, error: str
) -> None:
    collector = make_collector(FakeTriton(), Clock(), model_repository=llm_repository(tmp_path))
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/v1/models/{model}/engine-arguments")
    assert status == 404
    assert error in body["error"]


async def test_a_repository_that_hangs_is_a_gateway_timeout_within_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    reads: list[str] = []

    def hanging_read(repository: Path, model: str) -> Any:
        reads.append(model)
        release.wait(timeout=30)
        raise AssertionError("the read outlived its deadline and was still awaited")

    monkeypatch.setattr(collecting, "REPOSITORY_READ_SECONDS", 0.2)
    monkeypatch.setattr(repositories, "read_repository_arguments", hanging_read)
    collector = make_collector(FakeTriton(), Clock(), model_repository=llm_repository(tmp_path))
    try:
        async with serving_app(collector) as url:
            status, body = await get(f"{url}/v1/models/tiny_llm/engine-arguments")
            again, _ = await get(f"{url}/v1/models/tiny_llm/engine-arguments")
    finally:
        release.set()
    assert status == again == 504
    assert body["error"] == "reading model tiny_llm's engine arguments took over 0.2 s"
    assert reads == ["tiny_llm"]  # the second request waited on the hung read, started none


async def test_without_a_model_repository_there_are_no_engine_arguments_to_serve() -> None:
    collector = make_collector(FakeTriton(), Clock())
    async with serving_app(collector) as url:
        status, body = await get(f"{url}/v1/models/tiny_llm/engine-arguments")
    assert status == 404
    assert "--model-repository" in body["error"]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models/%2E%2E/engine-arguments",
        "/v1/models/..%2Fmodels%2Ftiny_llm/engine-arguments",
        "/v1/models/%2E/engine-arguments",
        "/v1/models/../engine-arguments",
        "/v1/models/a%5Cb/engine-arguments",
    ],
)
async def test_a_name_that_would_leave_the_repository_reads_nothing(
    tmp_path: Path, path: str
) -> None:
    collector = make_collector(FakeTriton(), Clock(), model_repository=llm_repository(tmp_path))
    async with serving_app(collector) as url:
        status, body = await get_raw(f"{url}{path}")
    # The router hands the handler the name with its escapes decoded: the check is what stops it.
    assert status == 400
    assert "is not a model name" in body["error"]
