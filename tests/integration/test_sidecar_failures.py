"""What a client sees fail against what the sidecar counts, on a real tritonserver whose queue
refuses requests.

A profile with a short queue timeout and a one-request queue under a steady load makes Triton
refuse requests two ways, both as HTTP 503: a request that waited past the timeout (Triton 2.51
counts it in `nv_inference_request_failure{reason="REJECTED"}`), and a request that found the
queue full (counted nowhere: neither its metrics nor its statistics move). The sidecar must
count every one of the first kind, and the requests it counts, together with the full-queue
refusals, must be every request the client sent: that is what lets a canary tell the refused
ones by its share of the arrivals (`batchpilot.policy.verdicts`).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators
from batchpilot.policy import rendering
from batchpilot_harness import demo_models, loadgen, local_sidecar, local_triton
from batchpilot_triton import servers
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

MODEL = demo_models.GPU_SIM
REFUSING = {
    "maxQueueDelayMicroseconds": 20_000,
    "queuePolicy": {
        "maxQueueSize": 1,
        "timeoutAction": "REJECT",
        "defaultTimeoutMicroseconds": 5000,
    },
}
"""Waits 20 ms for a batch but lets a request wait only 5 ms, and queues one at a time: every
request that finds the queue empty times out in it, every other one finds it full."""
TIMED_OUT = "Request timeout expired"
QUEUE_FULL = "Exceeds maximum queue size"


def status(url: str) -> Any:
    with urllib.request.urlopen(f"{url}/status", timeout=10) as response:
        return json.loads(response.read())


def read_after(url: str, instant: datetime.datetime, timeout: float = 20.0) -> Any:
    """The sidecar's /status once its latest reading of Triton's metrics is from after
    `instant`: every request of a load that ended then is in it."""
    deadline = time.monotonic() + timeout
    while True:
        found = status(url)
        read_at = found["sources"]["tritonMetrics"]["lastSuccessAt"]
        if read_at is not None and datetime.datetime.fromisoformat(read_at) > instant:
            return found
        assert time.monotonic() < deadline, f"no reading after {instant}: {found['sources']}"
        time.sleep(0.2)


async def refusing(server: local_triton.LocalTriton) -> None:
    async with servers.TritonServer(server.http_url) as triton:
        settings = rendering.render(specs.Profile.model_validate(REFUSING))
        await actuators.apply_profile(triton, MODEL, settings, profile="refusing")


async def load(server: local_triton.LocalTriton) -> list[loadgen.RequestRecord]:
    payload = loadgen.InferencePayload.for_input(
        model=MODEL, input_name="INPUT", datatype="FP32", shape=[1, 16]
    )
    result = await loadgen.run_load(
        base_url=server.http_url,
        payload=payload,
        phases=[loadgen.Phase(rate=150, seconds=4)],
        seed=3,
    )
    return list(result.records)


@pytest.mark.timeout(180)
def test_the_sidecar_counts_every_refusal_triton_counts_and_the_rest_is_the_full_queue_s(
    triton_server: TritonFactory, tmp_path: Path
) -> None:
    server = triton_server(MODEL)
    asyncio.run(refusing(server))  # before the sidecar: its window holds no warm-up request
    arguments = ("--interval", "0.5", "--rate-window", "120")  # one window over the whole test
    with local_sidecar.running(server, *arguments, log=tmp_path / "sidecar.log") as sidecar:
        read_after(sidecar.url, datetime.datetime.now(datetime.UTC))
        records = asyncio.run(load(server))
        ended = datetime.datetime.now(datetime.UTC)
        window = read_after(sidecar.url, ended)["models"][MODEL]["window"]

    def failed_with(message: str) -> int:
        return sum(1 for r in records if r.status == 503 and message in (r.error or ""))

    succeeded = sum(1 for record in records if record.succeeded)
    timed_out, queue_full = failed_with(TIMED_OUT), failed_with(QUEUE_FULL)
    print(
        f"\nclient: {len(records)} sent, {succeeded} succeeded, {timed_out} timed out in the "
        f"queue, {queue_full} refused by a full queue; sidecar: "
        f"{window['requestsSucceeded']:.0f} succeeded, {window['requestsFailed']:.0f} failed"
    )
    assert succeeded + timed_out + queue_full == len(records), "no other kind of failure"
    assert timed_out > 0, "requests that found the queue empty waited past its timeout"
    assert queue_full > 0, "requests that found a request queued were refused"
    assert window["requestsFailed"] == timed_out
    assert window["requestsSucceeded"] == succeeded
    assert window["requestsSucceeded"] + window["requestsFailed"] + queue_full == len(records)
