"""The Triton actuator against a real tritonserver: apply, idempotence, refusal, rollback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from batchpilot.applying import actuators, overrides
from batchpilot.policy import rendering, specs
from batchpilot_harness import demo_models, loadgen, local_triton, processes
from batchpilot_triton import modelconfigs, servers
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

INTERACTIVE = specs.Profile.model_validate(
    {
        "maxQueueDelayMicroseconds": 2000,
        "preferredBatchSizes": [4, 8],
        "maxBatchSize": 16,
        "priorityLevels": 2,
        "defaultPriorityLevel": 2,
        "queuePolicy": {
            "timeoutAction": "REJECT",
            "defaultTimeoutMicroseconds": 50000,
            "maxQueueSize": 512,
        },
    }
)
BULK = specs.Profile.model_validate(
    {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]}
)
# No queue timeout: a reload stalls the queue for its length, and a profile whose queue policy
# rejects requests after 50 ms would reject those (that is what the readiness-gate drain is for).
PATIENT_INTERACTIVE = specs.Profile.model_validate(
    {"maxQueueDelayMicroseconds": 2000, "preferredBatchSizes": [4, 8], "maxBatchSize": 16}
)


def stub_processes(server: local_triton.LocalTriton) -> set[int]:
    """The server's Python-backend stubs: a real reload replaces them."""
    return set(processes.group_members(server.pid)) - {server.pid}


async def served(server: local_triton.LocalTriton) -> dict[str, Any]:
    async with servers.TritonServer(server.http_url) as triton:
        return await triton.model_config(demo_models.GPU_SIM)


async def apply(
    server: local_triton.LocalTriton, profile: specs.Profile, name: str, **options: Any
) -> actuators.Applied:
    async with servers.TritonServer(server.http_url) as triton:
        return await actuators.apply_profile(
            triton, demo_models.GPU_SIM, rendering.render(profile), profile=name, **options
        )


@pytest.mark.timeout(90)
async def test_apply_changes_dynamic_batching_and_again_does_no_reload(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM)

    first = await apply(server, INTERACTIVE, "interactive")
    config = await served(server)
    assert first.reloaded
    assert first.previous_profile is None
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 2000
    assert batching["preferred_batch_size"] == [4, 8]
    assert (batching["priority_levels"], batching["default_priority_level"]) == (2, 2)
    assert batching["default_queue_policy"]["max_queue_size"] == 512
    assert config["max_batch_size"] == 16
    assert modelconfigs.applied_profile(config) == "interactive"

    stubs = stub_processes(server)
    again = await apply(server, INTERACTIVE, "interactive")
    assert not again.reloaded
    assert stub_processes(server) == stubs, "an unchanged profile must not reload the model"

    back = await apply(server, BULK, "bulk")
    config = await served(server)
    assert back.reloaded
    assert back.previous_profile == "interactive"
    assert config["max_batch_size"] == 128, "the model's own max_batch_size comes back"
    assert config["dynamic_batching"]["priority_levels"] == 0


@pytest.mark.timeout(60)
async def test_unload_before_load_applies_too(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM)
    applied = await apply(server, BULK, "bulk", unload_first=True)
    assert applied.reloaded
    assert (await served(server))["dynamic_batching"]["preferred_batch_size"] == [32, 64]


@pytest.mark.timeout(60)
async def test_profile_the_model_cannot_take_is_refused_and_nothing_changes(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM)
    before = await served(server)
    too_big = specs.Profile.model_validate({"maxQueueDelayMicroseconds": 100, "maxBatchSize": 256})
    with pytest.raises(
        overrides.ProfileRefused,
        match="maxBatchSize 256 is above model 'gpu_sim''s own max_batch_size 128",
    ):
        await apply(server, too_big, "huge")
    assert await served(server) == before


@pytest.mark.timeout(90)
async def test_failed_load_restores_the_previous_configuration(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM)
    await apply(server, BULK, "bulk")
    before = await served(server)
    # Triton refuses priority levels without a valid default level; the API never renders
    # this, so it stands for any configuration a server rejects.
    rejected = rendering.Settings(
        dynamic_batching={**rendering.render(BULK).dynamic_batching, "priority_levels": 2},
        max_batch_size=None,
    )
    async with servers.TritonServer(server.http_url) as triton:
        with pytest.raises(actuators.ApplyFailed) as failure:
            await actuators.apply_profile(
                triton, demo_models.GPU_SIM, rejected, profile="broken", verify_timeout=10
            )
        assert failure.value.rolled_back
        assert "applying broken to gpu_sim failed" in str(failure.value)
        assert "previous configuration restored" in str(failure.value)
        assert await triton.model_ready(demo_models.GPU_SIM)
    assert await served(server) == before


@pytest.mark.timeout(60)
async def test_server_not_in_explicit_mode_is_named_as_such(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM, explicit=False)
    with pytest.raises(servers.ExplicitModeRequired, match="--model-control-mode=explicit"):
        await apply(server, BULK, "bulk")


@pytest.mark.timeout(30)
async def test_unreachable_server_fails_fast() -> None:
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    started = time.monotonic()
    async with servers.TritonServer(f"http://127.0.0.1:{port}", request_timeout=2) as triton:
        with pytest.raises(servers.Unreachable, match=f"127.0.0.1:{port}"):
            await triton.model_config(demo_models.GPU_SIM)
    assert time.monotonic() - started < 3


@pytest.mark.timeout(180)
async def test_twenty_switches_under_load_fail_no_request(
    triton_server: TritonFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    server = triton_server(demo_models.GPU_SIM)
    switches = 24
    seconds = 30.0
    payload = loadgen.InferencePayload.for_input(
        model=demo_models.GPU_SIM, input_name="INPUT", datatype="FP32", shape=[1, 16]
    )
    load = asyncio.create_task(
        loadgen.run_load(
            base_url=server.http_url,
            payload=payload,
            phases=[loadgen.Phase(rate=200, seconds=seconds)],
            seed=3,
        )
    )
    windows: list[tuple[float, float]] = []
    started = time.monotonic() + 0.05  # the load generator's own start lead
    async with servers.TritonServer(server.http_url) as triton:
        await asyncio.sleep(2)
        for number in range(switches):
            profile, name = (PATIENT_INTERACTIVE, "interactive") if number % 2 else (BULK, "bulk")
            began = time.monotonic() - started
            applied = await actuators.apply_profile(
                triton, demo_models.GPU_SIM, rendering.render(profile), profile=name
            )
            assert applied.reloaded
            windows.append((began, time.monotonic() - started))
            await asyncio.sleep(0.2)
    result = await load
    summary = result.summary()
    during = [
        record.latency * 1000
        for record in result.records
        if record.latency is not None
        and record.sent is not None
        and any(start <= record.sent <= end for start, end in windows)
    ]
    steady = [
        record.latency * 1000
        for record in result.records
        if record.latency is not None
        and record.sent is not None
        and record.sent > windows[-1][1] + 1
    ]
    with capsys.disabled():
        print(
            f"\n{switches} switches under 200 req/s: {summary.describe()}\n"
            f"worst latency during switches {max(during):.0f} ms over {len(during)} requests; "
            f"steady after them: max {max(steady, default=0):.0f} ms"
        )
    assert len(windows) >= 20
    assert summary.not_sent == 0
    assert summary.failed == 0, [r.error for r in result.records if r.error][:5]
    assert summary.succeeded == summary.scheduled
