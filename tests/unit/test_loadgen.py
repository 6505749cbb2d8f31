"""The load generator's schedule, accounting and summaries, against a small in-process server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from batchpilot_harness import loadgen


def test_arrivals_follow_the_rate_of_each_phase() -> None:
    phases = [
        loadgen.Phase(rate=1000, seconds=2),
        loadgen.Phase(rate=0, seconds=1),
        loadgen.Phase(rate=100, seconds=2),
    ]

    arrivals = loadgen.poisson_arrivals(phases, seed=3)

    by_phase = [[a.offset for a in arrivals if a.phase == i] for i in range(3)]
    assert len(by_phase[0]) == pytest.approx(2000, rel=0.1)
    assert by_phase[1] == []
    assert len(by_phase[2]) == pytest.approx(200, rel=0.25)
    assert all(0 <= offset < 2 for offset in by_phase[0])
    assert all(3 <= offset < 5 for offset in by_phase[2])
    offsets = [a.offset for a in arrivals]
    assert offsets == sorted(offsets)


def test_arrivals_repeat_for_a_seed_and_differ_across_seeds() -> None:
    phases = [loadgen.Phase(rate=50, seconds=1)]

    assert loadgen.poisson_arrivals(phases, seed=1) == loadgen.poisson_arrivals(phases, seed=1)
    assert loadgen.poisson_arrivals(phases, seed=1) != loadgen.poisson_arrivals(phases, seed=2)


def test_phase_parses_rate_and_seconds() -> None:
    assert loadgen.Phase.parse("800:2.5") == loadgen.Phase(rate=800, seconds=2.5)
    with pytest.raises(ValueError, match="RATE:SECONDS"):
        loadgen.Phase.parse("800")
    with pytest.raises(ValueError, match="seconds > 0"):
        loadgen.Phase.parse("800:0")


def test_payload_is_a_kserve_v2_request_of_the_given_shape() -> None:
    payload = loadgen.InferencePayload.for_input(
        model="m", input_name="INPUT", datatype="FP32", shape=[2, 3]
    )

    (tensor,) = json.loads(payload.body)["inputs"]
    assert tensor["name"] == "INPUT"
    assert tensor["shape"] == [2, 3]
    assert tensor["datatype"] == "FP32"
    assert len(tensor["data"]) == 6


def record(
    *, sent: bool = True, status: int | None = 200, latency: float = 0.01
) -> loadgen.RequestRecord:
    return loadgen.RequestRecord(
        phase=0,
        scheduled=0.0,
        sent=0.002 if sent else None,
        latency=latency if sent and status is not None else None,
        status=status if sent else None,
    )


def test_summary_counts_outcomes_and_takes_percentiles_of_successes() -> None:
    records = [
        *(record(latency=(i + 1) / 1000) for i in range(100)),
        record(status=503, latency=5.0),
        record(status=None),
        record(sent=False),
    ]

    summary = loadgen.LoadSummary.of(records, seconds=2.0)

    assert (summary.scheduled, summary.sent, summary.not_sent) == (103, 102, 1)
    assert (summary.succeeded, summary.failed) == (100, 2)
    assert summary.achieved_rate == 50.0
    assert summary.latency_p50_ms == pytest.approx(50.5)
    assert summary.latency_max_ms == pytest.approx(100.0)
    assert summary.max_send_lag_ms == pytest.approx(2.0)


class FakeTriton:
    """Answers infer requests after `delay` seconds; every `fail_every`-th one with 500."""

    def __init__(self, *, delay: float = 0.0, fail_every: int = 0) -> None:
        self.delay = delay
        self.fail_every = fail_every
        self.received = 0

    async def infer(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["inputs"][0]["name"] == "INPUT"
        self.received += 1
        number = self.received
        await asyncio.sleep(self.delay)
        if self.fail_every and number % self.fail_every == 0:
            return web.json_response({"error": "injected"}, status=500)
        return web.json_response({"outputs": []})

    async def metadata(self, request: web.Request) -> web.Response:
        inputs = [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 4]}]
        return web.json_response({"name": request.match_info["model"], "inputs": inputs})


@pytest.fixture
def fake() -> FakeTriton:
    return FakeTriton()


@pytest.fixture
async def base_url(fake: FakeTriton) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", fake.infer)
    app.router.add_get("/v2/models/{model}", fake.metadata)
    async with TestServer(app) as server:
        yield str(server.make_url("")).rstrip("/")


async def test_every_arrival_is_sent_and_recorded(fake: FakeTriton, base_url: str) -> None:
    fake.fail_every = 10
    async with aiohttp.ClientSession() as session:
        payload = await loadgen.payload_from_metadata(session, base_url, "m", batch_size=2)
    phases = [loadgen.Phase(rate=200, seconds=0.5), loadgen.Phase(rate=400, seconds=0.5)]

    result = await loadgen.run_load(base_url=base_url, payload=payload, phases=phases, seed=5)

    summary = result.summary()
    assert summary.scheduled == len(loadgen.poisson_arrivals(phases, seed=5)) == fake.received
    assert summary.not_sent == 0
    assert summary.failed == fake.received // 10
    failures = [r for r in result.records if not r.succeeded]
    assert {r.status for r in failures} == {500}
    assert all(r.error is not None and "injected" in r.error for r in failures)
    assert result.summary(0).scheduled + result.summary(1).scheduled == summary.scheduled
    assert result.summary(1).offered_rate > result.summary(0).offered_rate


async def test_arrivals_beyond_the_in_flight_bound_are_not_sent(
    fake: FakeTriton, base_url: str
) -> None:
    fake.delay = 0.3
    payload = loadgen.InferencePayload.for_input(
        model="m", input_name="INPUT", datatype="FP32", shape=[1, 4]
    )

    result = await loadgen.run_load(
        base_url=base_url,
        payload=payload,
        phases=[loadgen.Phase(rate=100, seconds=0.5)],
        max_in_flight=2,
    )

    summary = result.summary()
    assert summary.sent == fake.received <= 2 * 2  # two at a time, each 0.3 s, over 0.5 s
    assert summary.not_sent == summary.scheduled - summary.sent > 0
    assert summary.failed == 0
    unsent = [r.error for r in result.records if r.sent is None]
    assert set(unsent) == {"2 requests in flight already"}


async def test_a_picked_endpoint_gets_each_request_and_none_leaves_it_unsent(
    fake: FakeTriton, base_url: str
) -> None:
    payload = loadgen.InferencePayload.for_input(
        model="m", input_name="INPUT", datatype="FP32", shape=[1, 4]
    )
    picks = 0

    def every_other() -> str | None:
        nonlocal picks
        picks += 1
        return base_url if picks % 2 else None

    result = await loadgen.run_load(
        base_url=every_other, payload=payload, phases=[loadgen.Phase(rate=100, seconds=0.5)]
    )

    summary = result.summary()
    assert picks == summary.scheduled > 0
    assert summary.sent == fake.received == summary.succeeded == (picks + 1) // 2
    unsent = [r.error for r in result.records if r.sent is None]
    assert set(unsent) == {"no endpoint to send it to"}


async def test_a_server_that_is_gone_makes_failures_not_exceptions() -> None:
    payload = loadgen.InferencePayload.for_input(
        model="m", input_name="INPUT", datatype="FP32", shape=[1, 4]
    )

    result = await loadgen.run_load(
        base_url="http://127.0.0.1:9",  # discard port: nothing listens
        payload=payload,
        phases=[loadgen.Phase(rate=50, seconds=0.2)],
    )

    summary = result.summary()
    assert summary.failed == summary.sent == summary.scheduled > 0
    assert all(r.status is None and r.error for r in result.records)
    assert all(r.error.startswith("http://127.0.0.1:9: ") for r in result.records if r.error)
