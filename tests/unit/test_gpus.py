"""GPU telemetry without a GPU: NVML through a fake library object, DCGM pages, fallbacks."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from batchpilot_harness import local_triton
from batchpilot_sidecar import commands, gpus
from fake_nvml import GIB, FakeGpu, FakeNvml


def reader(library: FakeNvml | Callable[[], Any], **options: Any) -> gpus.NvmlReader:
    load = library if callable(library) and not isinstance(library, FakeNvml) else lambda: library
    return gpus.NvmlReader(load=load, **options)


def test_every_gpu_is_read_in_our_units() -> None:
    library = FakeNvml(FakeGpu(), FakeGpu(uuid="GPU-0001", utilization_percent=90))
    telemetry = reader(library).read()
    assert telemetry.available
    assert telemetry.source == "nvml"
    first, second = telemetry.gpus
    assert first == gpus.GpuReading(
        index=0,
        uuid="GPU-0000",
        name="NVIDIA L4",
        utilization=0.37,
        memory_used_bytes=6 * GIB,
        memory_reserved_bytes=0,
        memory_total_bytes=24 * GIB,
        power_watts=41.5,
        power_limit_watts=72.0,
        sm_clock_mhz=2040,
        temperature_celsius=55,
    )
    assert first.memory_free_bytes == 18 * GIB
    assert (second.index, second.uuid, second.utilization) == (1, "GPU-0001", 0.9)
    assert telemetry.least_free_memory() == 18 * GIB


def test_without_the_bindings_the_gpu_is_unavailable_and_says_why() -> None:
    def missing() -> Any:
        raise ModuleNotFoundError("No module named 'pynvml'")

    telemetry = reader(missing).read()
    assert not telemetry.available
    assert telemetry.gpus == ()
    assert telemetry.reason is not None
    assert "nvidia-ml-py" in telemetry.reason
    assert "No module named 'pynvml'" in telemetry.reason


@pytest.mark.parametrize(
    "error", ["NVML Shared Library Not Found", "Driver Not Loaded", "Insufficient Permissions"]
)
def test_when_nvml_cannot_start_the_reason_is_nvmls_own(error: str) -> None:
    telemetry = reader(FakeNvml(FakeGpu(), init_error=error)).read()
    assert not telemetry.available
    assert telemetry.reason == f"NVML could not be initialised: {error}"


def test_a_query_one_gpu_does_not_support_leaves_that_value_out_and_names_it() -> None:
    library = FakeNvml(FakeGpu(), FakeGpu(uuid="GPU-0001", failing={"power": "Not Supported"}))
    telemetry = reader(library).read()
    healthy, partial = telemetry.gpus
    assert healthy.problems == ()
    assert partial.power_watts is None
    assert partial.power_limit_watts == 72.0
    assert partial.utilization == 0.37
    assert partial.problems == ("power: Not Supported",)


def test_a_lost_gpu_is_reported_with_nothing_but_its_problem() -> None:
    library = FakeNvml(FakeGpu(), FakeGpu(failing={"handle": "GPU is lost"}))
    telemetry = reader(library).read()
    lost = telemetry.gpus[1]
    assert lost == gpus.GpuReading(index=1, problems=("handle: GPU is lost",))
    assert lost.memory_free_bytes is None
    assert telemetry.least_free_memory() is None, "unknown for one GPU: unknown"


def test_no_gpu_in_the_container_is_unavailable() -> None:
    telemetry = reader(FakeNvml()).read()
    assert not telemetry.available
    assert telemetry.reason == "NVML sees no GPU in this container"


def test_initialisation_is_retried_after_a_while_and_shut_down_at_close() -> None:
    now = [0.0]
    library = FakeNvml(FakeGpu(), init_error="Driver Not Loaded")
    nvml = reader(library, retry_seconds=60, clock=lambda: now[0])
    assert not nvml.read().available
    now[0] = 30
    assert not nvml.read().available
    assert library.init_calls == 1, "no retry within the retry period"
    library.init_error = None
    now[0] = 61
    assert nvml.read().available
    assert library.init_calls == 2
    nvml.close()
    assert library.shutdown_calls == 1


def test_the_real_bindings_on_this_machine_report_gpus_or_a_reason() -> None:
    nvml = gpus.NvmlReader()
    try:
        telemetry = nvml.read()
    finally:
        nvml.close()
    if telemetry.available:
        assert all(gpu.memory_total_bytes for gpu in telemetry.gpus)
    else:
        assert telemetry.gpus == ()
        assert telemetry.reason


# A DCGM exporter page as its default counters and its Kubernetes pod mapping write it: two
# GPUs of one node, each used by another pod.
DCGM_LABELS = {
    "0": 'gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A10G",Hostname="node-1",'
    'pod="triton-0",namespace="ml",container="triton"',
    "1": 'gpu="1",UUID="GPU-bbbb",device="nvidia1",modelName="NVIDIA A10G",Hostname="node-1",'
    'pod="other-0",namespace="ml",container="x"',
}
DCGM_VALUES = {
    "DCGM_FI_DEV_SM_CLOCK": ("SM clock frequency (in MHz).", 1710, 210),
    "DCGM_FI_DEV_GPU_TEMP": ("GPU temperature (in C).", 61, 33),
    "DCGM_FI_DEV_POWER_USAGE": ("Power draw (in W).", 148.25, 24.5),
    "DCGM_FI_DEV_GPU_UTIL": ("GPU utilization (in %).", 83, 0),
    "DCGM_FI_DEV_FB_FREE": ("Framebuffer memory free (in MiB).", 8192, 22000),
    "DCGM_FI_DEV_FB_USED": ("Framebuffer memory used (in MiB).", 14336, 528),
    "DCGM_FI_DEV_XID_ERRORS": ("Value of the last XID error encountered.", 0, 0),
}
DCGM_PAGE = "".join(
    f"# HELP {name} {help_text}\n# TYPE {name} gauge\n"
    f"{name}{{{DCGM_LABELS['0']}}} {first}\n{name}{{{DCGM_LABELS['1']}}} {second}\n"
    for name, (help_text, first, second) in DCGM_VALUES.items()
)


def test_a_dcgm_page_gives_every_gpu_in_our_units() -> None:
    first, second = gpus.parse_dcgm(DCGM_PAGE)
    assert first == gpus.GpuReading(
        index=0,
        uuid="GPU-aaaa",
        name="NVIDIA A10G",
        utilization=0.83,
        memory_used_bytes=14336 * 1024**2,
        memory_total_bytes=(14336 + 8192) * 1024**2,
        power_watts=148.25,
        sm_clock_mhz=1710,
        temperature_celsius=61,
    )
    assert first.power_limit_watts is None, "not in DCGM's default counters: not invented"
    assert second.uuid == "GPU-bbbb"


def test_with_pod_labels_only_this_pods_gpus_are_kept() -> None:
    (only,) = gpus.parse_dcgm(DCGM_PAGE, pod=gpus.PodRef("triton-0", "ml"))
    assert only.uuid == "GPU-aaaa"
    (by_name,) = gpus.parse_dcgm(DCGM_PAGE, pod=gpus.PodRef("triton-0"))
    assert by_name.uuid == "GPU-aaaa"


def test_a_pod_of_the_same_name_in_another_namespace_is_not_this_one() -> None:
    assert gpus.parse_dcgm(DCGM_PAGE, pod=gpus.PodRef("triton-0", "trading")) == ()


def test_a_page_without_pod_labels_is_refused_for_a_pod_not_given_the_nodes_gpus() -> None:
    unlabelled = DCGM_PAGE.replace(',pod="triton-0"', "").replace(',pod="other-0"', "")
    with pytest.raises(gpus.DcgmPageError, match="DCGM_EXPORTER_KUBERNETES=true"):
        gpus.parse_dcgm(unlabelled, pod=gpus.PodRef("triton-0", "ml"))
    assert len(gpus.parse_dcgm(unlabelled)) == 2, "without a Pod to look for, every GPU"


def test_dcgms_reserved_memory_is_kept_apart_and_counted_in_the_total() -> None:
    reserved = (
        "# HELP DCGM_FI_DEV_FB_RESERVED Framebuffer memory reserved (in MiB).\n"
        "# TYPE DCGM_FI_DEV_FB_RESERVED gauge\n"
        f"DCGM_FI_DEV_FB_RESERVED{{{DCGM_LABELS['0']}}} 615\n"
        f"DCGM_FI_DEV_FB_RESERVED{{{DCGM_LABELS['1']}}} 615\n"
    )
    (mine,) = gpus.parse_dcgm(DCGM_PAGE + reserved, pod=gpus.PodRef("triton-0", "ml"))
    assert mine.memory_used_bytes == 14336 * 1024**2
    assert mine.memory_reserved_bytes == 615 * 1024**2
    assert mine.memory_total_bytes == (14336 + 8192 + 615) * 1024**2
    assert mine.memory_free_bytes == 8192 * 1024**2


def test_nvml_memory_is_v2s_used_with_the_reserved_memory_apart() -> None:
    # On the lent H200 NVML's v1 "used" read 615 MiB above nvidia-smi's: it counts reserved memory.
    library = FakeNvml(FakeGpu(memory_used=6 * GIB, memory_reserved=615 * 1024**2))
    (gpu,) = reader(library).read().gpus
    assert gpu.memory_used_bytes == 6 * GIB, "as nvidia-smi and DCGM report it"
    assert gpu.memory_reserved_bytes == 615 * 1024**2
    assert gpu.memory_free_bytes == 18 * GIB - 615 * 1024**2
    assert gpu.problems == ()


def test_without_v2_memory_info_v1_is_read_and_the_reading_says_what_it_counts() -> None:
    library = FakeNvml(FakeGpu(memory_used=6 * GIB, memory_reserved=GIB, memory_info_v2=False))
    (gpu,) = reader(library).read().gpus
    assert gpu.memory_used_bytes == 7 * GIB, "v1: reserved memory counted as used"
    assert gpu.memory_reserved_bytes is None
    assert gpu.memory_free_bytes == 17 * GIB
    (problem,) = gpu.problems
    assert problem.startswith("memory reserved: NVML's v2 memory info failed (Function Not Found)")


@pytest.fixture
async def dcgm_url() -> AsyncIterator[str]:
    """A DCGM exporter page on loopback at /metrics; /huge answers a page over the sidecar's
    cap and /moved redirects to /metrics."""

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=DCGM_PAGE)

    async def huge(_: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(_)
        line = b'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 1\n' * 4096
        for _chunk in range(64):  # 8 MiB, twice the cap
            await response.write(line)
        return response

    async def moved(_: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/metrics")

    async def garbled(_: web.Request) -> web.Response:
        return web.Response(text="DCGM_FI_DEV_GPU_UTIL{gpu=0 secret-looking words\n")

    async def down(_: web.Request) -> web.Response:
        return web.Response(status=503, reason="anything the server likes", text="a body")

    app = web.Application()
    app.router.add_get("/metrics", page)
    app.router.add_get("/huge", huge)
    app.router.add_get("/moved", moved)
    app.router.add_get("/garbled", garbled)
    app.router.add_get("/down", down)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}/metrics"
    await runner.cleanup()


async def read_once(monitor: gpus.GpuMonitor) -> gpus.GpuTelemetry:
    try:
        return await monitor.read()
    finally:
        await monitor.close()


async def test_the_monitor_reads_this_pods_gpus_from_dcgm_in_a_pod(dcgm_url: str) -> None:
    pod = gpus.PodRef("other-0", "ml")
    telemetry = await read_once(gpus.GpuMonitor(reader(FakeNvml()), dcgm_url=dcgm_url, pod=pod))
    assert telemetry.source == "dcgm"
    assert [gpu.uuid for gpu in telemetry.gpus] == ["GPU-bbbb"]


async def test_a_dcgm_page_over_the_cap_is_cut_off_and_said_so(dcgm_url: str) -> None:
    huge = dcgm_url.replace("/metrics", "/huge")
    telemetry = await read_once(gpus.GpuMonitor(reader(FakeNvml()), dcgm_url=huge))
    assert not telemetry.available
    assert telemetry.reason is not None
    assert telemetry.reason.endswith("the answer is larger than 4 MiB; cut off there")


async def test_a_dcgm_redirect_is_not_followed(dcgm_url: str) -> None:
    moved = dcgm_url.replace("/metrics", "/moved")
    telemetry = await read_once(gpus.GpuMonitor(reader(FakeNvml()), dcgm_url=moved))
    assert not telemetry.available
    assert telemetry.reason is not None
    assert telemetry.reason.endswith(
        f"DCGM exporter {moved}: answered HTTP 307, a redirect, which is not followed"
    )


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/garbled", "its page is not Prometheus' text format"),
        ("/down", "HTTP 503 Service Unavailable"),
    ],
)
async def test_what_a_dcgm_exporter_answered_is_said_by_kind_never_quoted(
    dcgm_url: str, path: str, said: str
) -> None:
    url = dcgm_url.replace("/metrics", path)
    telemetry = await read_once(gpus.GpuMonitor(reader(FakeNvml()), dcgm_url=url))
    assert telemetry.reason is not None
    assert telemetry.reason.endswith(f"DCGM exporter {url}: {said}")
    assert "secret-looking" not in telemetry.reason
    assert "anything the server likes" not in telemetry.reason


async def test_the_monitor_falls_back_to_dcgm_when_nvml_gives_nothing(dcgm_url: str) -> None:
    monitor = gpus.GpuMonitor(reader(FakeNvml(init_error="Driver Not Loaded")), dcgm_url=dcgm_url)
    try:
        telemetry = await monitor.read()
    finally:
        await monitor.close()
    assert telemetry.source == "dcgm"
    assert [gpu.uuid for gpu in telemetry.gpus] == ["GPU-aaaa", "GPU-bbbb"]


async def test_the_monitor_prefers_nvml(dcgm_url: str) -> None:
    monitor = gpus.GpuMonitor(reader(FakeNvml(FakeGpu())), dcgm_url=dcgm_url)
    try:
        telemetry = await monitor.read()
    finally:
        await monitor.close()
    assert telemetry.source == "nvml"


async def test_without_nvml_or_dcgm_both_reasons_are_given() -> None:
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    monitor = gpus.GpuMonitor(
        reader(FakeNvml(init_error="Driver Not Loaded")), dcgm_url=f"http://127.0.0.1:{port}/m"
    )
    try:
        telemetry = await monitor.read()
    finally:
        await monitor.close()
    assert not telemetry.available
    assert telemetry.reason is not None
    assert telemetry.reason.startswith("NVML could not be initialised: Driver Not Loaded; DCGM")


async def test_a_failed_exporter_is_asked_again_only_after_the_retry_period() -> None:
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    now = [0.0]
    monitor = gpus.GpuMonitor(
        reader(FakeNvml()),
        dcgm_url=f"http://127.0.0.1:{port}/metrics",
        dcgm_retry_seconds=30,
        clock=lambda: now[0],
    )

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=DCGM_PAGE)

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app, access_log=None)
    try:
        failed = await monitor.read()
        assert failed.reason is not None
        assert "Cannot connect" in failed.reason
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        now[0] = 10.0
        assert (await monitor.read()).reason == failed.reason, "not asked within the period"
        now[0] = 31.0
        assert (await monitor.read()).source == "dcgm", "asked again after it"
    finally:
        await monitor.close()
        await runner.cleanup()


class HangingNvml(FakeNvml):
    """A driver whose device count blocks until released, counting the calls that blocked."""

    def __init__(self, *devices: FakeGpu) -> None:
        super().__init__(*devices)
        self.release = threading.Event()
        self.blocked = 0

    def nvmlDeviceGetCount(self) -> int:
        self.blocked += 1
        self.release.wait(timeout=30)
        return super().nvmlDeviceGetCount()


async def test_a_hanging_driver_costs_a_read_its_deadline_and_one_thread_not_one_per_read() -> None:
    nvml = HangingNvml(FakeGpu())
    monitor = gpus.GpuMonitor(reader(nvml), timeout=0.2)
    try:
        first = await monitor.read()
        second = await monitor.read()
        assert first.reason == second.reason == "NVML did not answer within 0.2 s"
        assert not first.available
        assert nvml.blocked == 1  # the second read waited on the first, started none
        nvml.release.set()
        for _ in range(50):  # the held read ends; the next one answers
            third = await monitor.read()
            if third.available:
                break
        assert third.source == "nvml"
    finally:
        nvml.release.set()
        await monitor.close()


HUNG_DRIVER = """
import asyncio, threading
from batchpilot_sidecar import gpus

class HungDriver:
    def read(self): threading.Event().wait()
    def close(self): threading.Event().wait()

async def main():
    monitor = gpus.GpuMonitor(HungDriver(), timeout=0.2)
    print((await monitor.read()).reason, flush=True)
    await monitor.close()

asyncio.run(main())
print("ended", flush=True)
"""


def test_a_hung_driver_does_not_keep_the_sidecar_from_ending() -> None:
    """Its read and its close never return: each costs its deadline, and the process still ends
    (a thread of the loop's default pool would be joined at exit, for ever)."""
    ended = subprocess.run(
        [sys.executable, "-c", HUNG_DRIVER], capture_output=True, text=True, timeout=30
    )
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.splitlines() == ["NVML did not answer within 0.2 s", "ended"]


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"POD_NAME": "triton-0", "HOSTNAME": "triton-0"}, "triton-0"),
        ({"HOSTNAME": "triton-1", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "triton-1"),
        # Outside a Pod the hostname names the machine, whose DCGM page is all its own.
        ({"HOSTNAME": "gpu-box"}, None),
        ({}, None),
    ],
)
def test_the_sidecar_looks_for_its_pod_only_in_a_pod(
    environment: dict[str, str], expected: str | None
) -> None:
    assert commands.default_pod_name(environment) == expected
