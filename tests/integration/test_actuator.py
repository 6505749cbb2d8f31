"""The Triton actuator against a real tritonserver: apply, idempotence, unload-first, refusal,
rollback."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, overrides
from batchpilot.policy import rendering
from batchpilot_harness import demo_models, loadgen, local_triton, procfs
from batchpilot_triton import modelconfigs, servers
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

R = TypeVar("R")
T = TypeVar("T")

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
    return procfs.children(server.pid)


def model_ready(server: local_triton.LocalTriton) -> bool | None:
    """Whether the server says gpu_sim is ready; None when it does not answer within 0.1 s, as
    when the connection lands on the HTTP thread that is busy with a load."""
    url = f"{server.http_url}/v2/models/{demo_models.GPU_SIM}/ready"
    try:
        with urllib.request.urlopen(url, timeout=0.1) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError:
        return False
    except OSError:
        return None


async def sampled_during(
    action: Awaitable[R], probe: Callable[[], T], *, interval: float = 0.01
) -> tuple[R, list[T]]:
    """`action`'s result, and `probe()` every `interval` seconds until it is done (in a worker
    thread, so that a slow probe does not hold up the action)."""
    task = asyncio.ensure_future(action)
    samples: list[T] = []
    while not task.done():
        samples.append(await asyncio.to_thread(probe))
        await asyncio.sleep(interval)
    return await task, samples


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


async def readiness_while_applying(
    server: local_triton.LocalTriton, profile: specs.Profile, name: str, **options: Any
) -> tuple[actuators.Applied, list[bool | None]]:
    return await sampled_during(
        apply(server, profile, name, **options), lambda: model_ready(server)
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
    # No stub started since (one an earlier reload replaced may still be exiting).
    assert stubs
    assert stub_processes(server) <= stubs, "an unchanged profile must not reload the model"

    back = await apply(server, BULK, "bulk")
    config = await served(server)
    assert back.reloaded
    assert back.previous_profile == "interactive"
    assert config["max_batch_size"] == 128, "the model's own max_batch_size comes back"
    assert config["dynamic_batching"]["priority_levels"] == 0


@pytest.mark.timeout(60)
async def test_reload_keeps_the_model_in_service_and_unload_first_takes_it_out_until_loaded(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM)

    plain, in_plain = await readiness_while_applying(server, BULK, "bulk")
    unloading, in_unloading = await readiness_while_applying(
        server, PATIENT_INTERACTIVE, "interactive", unload_first=True
    )

    assert plain.reloaded
    answered = in_plain.count(True) + in_plain.count(False)
    assert answered > 10, f"{answered} answers are too few to have watched the reload"
    assert False not in in_plain, f"out of service in {in_plain.count(False)} of {answered}"
    assert unloading.reloaded
    assert False in in_unloading, f"in service all {len(in_unloading)} samples: nothing unloaded"
    assert modelconfigs.applied_profile(await served(server)) == "interactive"


@pytest.mark.timeout(60)
async def test_unload_first_stops_the_old_instances_before_it_starts_new_ones(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM)
    old = stub_processes(server)

    _, stubs = await sampled_during(
        apply(server, BULK, "bulk", unload_first=True), lambda: stub_processes(server)
    )

    together = [sample for sample in stubs if sample & old and sample - old]
    assert not together, f"{len(together)} of {len(stubs)} samples saw old and new instances"


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
async def test_server_not_in_explicit_mode_is_refused_naming_the_flag_it_needs(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM, explicit=False)
    with pytest.raises(servers.ExplicitModeRequired, match="--model-control-mode=explicit"):
        await apply(server, BULK, "bulk")


@pytest.mark.timeout(30)
async def test_unreachable_server_is_named_in_an_error_within_the_request_timeout() -> None:
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
    rate = 200
    payload = loadgen.InferencePayload.for_input(
        model=demo_models.GPU_SIM, input_name="INPUT", datatype="FP32", shape=[1, 16]
    )
    load = asyncio.create_task(
        loadgen.run_load(
            base_url=server.http_url,
            payload=payload,
            phases=[loadgen.Phase(rate=rate, seconds=seconds)],
            seed=3,
            # The client may hold 10 s of the schedule open: in a busy run, a 2-s stall of this
            # process and answers up to 3.9 s late left 512 requests in flight and 155 unsent.
            # A reload that stopped serving for 10 s would still leave requests unsent.
            max_in_flight=10 * rate,
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
            f"\n{switches} switches under {rate} req/s: {summary.describe()}\n"
            f"worst latency during switches {max(during):.0f} ms over {len(during)} requests; "
            f"steady after them: max {max(steady, default=0):.0f} ms"
        )
    assert len(windows) >= 20
    assert summary.not_sent == 0
    assert summary.failed == 0, [r.error for r in result.records if r.error][:5]
    assert summary.succeeded == summary.scheduled
