"""The sidecar against a real tritonserver serving gpu_sim: the step-time fit recovers the emulated
accelerator, the recommended queue delay meets a p95 objective that static bulk settings miss,
and the standalone runner autotunes from a real sidecar process.

One server and one sidecar serve the module. The calibration load mixes requests of 1 to 64
items at a few per second each, all at once, under a 30 ms queue delay: batches of many sizes
form (requests merge), executions rarely overlap (so they seldom wait for the shared device),
and whatever slowly drifts on a busy 2-core machine (CPU contention, Python-backend wake-ups)
touches every batch size alike instead of biasing the sizes measured late.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http
from prometheus_client.parser import text_string_to_metric_families

from batchpilot import running, telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators
from batchpilot.policy import rendering
from batchpilot.signals import sidecars
from batchpilot_harness import demo_models, loadgen, local_sidecar, local_triton
from batchpilot_triton import scraping, servers
from builders import make_spec
from triton_fixtures import TritonFactory, run_command_until, triton_client

pytestmark = pytest.mark.integration

GPU_SIM = demo_models.GPU_SIM
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)
CALIBRATION_RATE = 3.0  # requests per second of each size
CALIBRATION_SECONDS = 20.0
CALIBRATION_DELAY_US = 30_000
# The objective and the load of the SLO test: at 100 requests per second, a bulk profile that
# waits 100 ms for batches answers in well over 80 ms; the recommended delay must not.
SLO_P95_MS = 80.0
RATE = 100.0
MEASURE_SECONDS = 10.0
STATIC_DELAY_US = 100_000
"""The static bulk profile's queue delay: alone past the objective."""


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@contextmanager
def sidecar_process(server: local_triton.LocalTriton, log: Path, *extra: str) -> Iterator[str]:
    """`batchpilot sidecar` for `server` as a child process; yields its URL once healthy, and
    checks that it stopped cleanly."""
    with local_sidecar.running(
        server,
        *("--interval", "0.5", "--rate-window", "5", *extra),
        command=("-m", "batchpilot", "sidecar"),
        log=log,
    ) as sidecar:
        yield sidecar.url
    assert sidecar.process.returncode == 0, log.read_text()
    assert log.read_text().rstrip().endswith("stopped")


def run_async(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """For module-scoped fixtures: a private event loop, leaving the current one alone."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


async def mixed_load(server: local_triton.LocalTriton, seconds: float) -> None:
    async def one_size(seed: int, items: int) -> loadgen.LoadResult:
        payload = loadgen.InferencePayload.for_input(
            model=GPU_SIM, input_name="INPUT", datatype="FP32", shape=[items, 16]
        )
        phases = [loadgen.Phase(rate=CALIBRATION_RATE, seconds=seconds)]
        return await loadgen.run_load(
            base_url=server.http_url, payload=payload, phases=phases, seed=seed
        )

    results = await asyncio.gather(*(one_size(i, n) for i, n in enumerate(CALIBRATION_SIZES)))
    assert all(result.summary().failed == 0 for result in results)


async def steady_load(server: local_triton.LocalTriton, seconds: float) -> loadgen.LoadSummary:
    payload = loadgen.InferencePayload.for_input(
        model=GPU_SIM, input_name="INPUT", datatype="FP32", shape=[1, 16]
    )
    result = await loadgen.run_load(
        base_url=server.http_url,
        payload=payload,
        phases=[loadgen.Phase(rate=RATE, seconds=seconds)],
        seed=7,
    )
    return result.summary()


@dataclass(frozen=True)
class Measured:
    """A steady load, and the mean time its requests spent in Triton's queue as Triton counts
    it: the part of the latency that the queue delay decides."""

    load: loadgen.LoadSummary
    mean_queue_ms: float


async def queue_counts(server: local_triton.LocalTriton) -> tuple[int, int]:
    async with servers.TritonServer(server.http_url) as triton:
        (stats,) = await triton.statistics(GPU_SIM)
    queue = stats["inference_stats"]["queue"]
    return int(queue["count"]), int(queue["ns"])


async def measured_load(server: local_triton.LocalTriton, seconds: float) -> Measured:
    count, ns = await queue_counts(server)
    load = await steady_load(server, seconds)
    count_after, ns_after = await queue_counts(server)
    assert count_after > count
    return Measured(load=load, mean_queue_ms=(ns_after - ns) / (count_after - count) / 1e6)


async def apply(server: local_triton.LocalTriton, profile: dict[str, Any], name: str) -> None:
    async with servers.TritonServer(server.http_url) as triton:
        settings = rendering.render(specs.Profile.model_validate(profile))
        await actuators.apply_profile(triton, GPU_SIM, settings, profile=name)


@dataclass(frozen=True)
class Calibration:
    sidecar_url: str
    step_time: dict[str, Any]
    truth: demo_models.StepTime
    overhead_ms: float
    """Triton's compute time per execution beyond the emulated device's: the Python backend's
    own cost, which the step time Triton reports includes."""


def compute_totals(client: tritonclient.http.InferenceServerClient) -> tuple[float, int]:
    """Compute milliseconds and executions over every batch size, from the statistics API."""
    (stats,) = client.get_inference_statistics(GPU_SIM)["model_stats"]
    infer = [batch["compute_infer"] for batch in stats["batch_stats"]]
    return sum(i["ns"] for i in infer) / 1e6, sum(i["count"] for i in infer)


@pytest.fixture(scope="module")
def server(module_triton_server: TritonFactory) -> local_triton.LocalTriton:
    return module_triton_server(GPU_SIM)


@pytest.fixture(scope="module")
def calibration(
    server: local_triton.LocalTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Calibration]:
    """The sidecar, after it watched the calibration load."""
    run_async(apply(server, {"maxQueueDelayMicroseconds": CALIBRATION_DELAY_US}, "calibration"))
    run_async(mixed_load(server, 2.0))  # the first executions after a load are slow
    log = tmp_path_factory.mktemp("sidecar") / "sidecar.log"
    with sidecar_process(server, log) as url, triton_client(server) as client:
        truth = demo_models.StepTime.from_model_config(client.get_model_config(GPU_SIM))
        with urllib.request.urlopen(server.metrics_url, timeout=10) as page:
            before = scraping.parse(page.read().decode())
        compute_before = compute_totals(client)
        run_async(mixed_load(server, CALIBRATION_SECONDS))
        load_ended = time.monotonic()
        with urllib.request.urlopen(server.metrics_url, timeout=10) as page:
            after = scraping.parse(page.read().decode())
        compute_ms, executions = (
            total - earlier
            for total, earlier in zip(compute_totals(client), compute_before, strict=True)
        )
        device = scraping.increase(before, after, GPU_SIM)
        device_ms = 1000 * (device.device_busy_seconds + device.device_wait_seconds)
        # The sidecar refits at most every 5 s, after reading the statistics: wait for a fit
        # made after the load (all its responses were in).
        deadline = time.monotonic() + 15
        while True:
            step_time = get_json(f"{url}/status")["models"][GPU_SIM]["stepTime"]
            since_load = time.monotonic() - load_ended
            if step_time["status"] == "fitted" and step_time["fittedAgoSeconds"] < since_load - 0.1:
                break
            assert time.monotonic() < deadline, step_time
            time.sleep(0.5)
        yield Calibration(
            sidecar_url=url,
            step_time=step_time,
            truth=truth,
            overhead_ms=(compute_ms - device_ms) / executions,
        )


@pytest.mark.timeout(150)
def test_the_fit_recovers_the_emulated_step_time_within_15_percent(
    calibration: Calibration,
) -> None:
    fitted, truth = calibration.step_time, calibration.truth
    device_t0 = fitted["t0Ms"] - calibration.overhead_ms
    print(
        f"\nstep time fitted: t0 {fitted['t0Ms']:.3f} ms (minus {calibration.overhead_ms:.3f} ms "
        f"of Python-backend overhead: {device_t0:.3f}; truth {truth.base_ms}), c "
        f"{fitted['cMs']:.4f} ms (truth {truth.per_item_ms}), alpha {fitted['alpha']:.3f} "
        f"(truth {truth.exponent}); R^2 {fitted['rSquared']:.4f}, RMSE {fitted['rmseMs']:.3f} ms, "
        f"{len(fitted['batchSizes'])} batch sizes from {fitted['batchSizes'][0]} to "
        f"{fitted['batchSizes'][-1]}, {fitted['executions']} executions, outliers"
        f" {fitted['outliers']}"
    )

    sizes = fitted["batchSizes"]

    def fitted_growth_ms(batch: int) -> float:
        return float(fitted["cMs"] * batch ** fitted["alpha"])

    def fitted_step_ms(batch: int) -> float:
        return float(fitted["t0Ms"]) + fitted_growth_ms(batch)

    def true_growth_ms(batch: int) -> float:
        return truth.per_item_ms * batch**truth.exponent

    # Triton's step time is the emulated device's plus the Python backend's cost around it. That
    # cost's mean is taken over every execution, the stalled ones too, which the fit discounts as
    # outliers: a busy run measured a mean of 1.58 ms while its fit's t0 held 0.65 ms of it. So
    # the fitted curve is held at every measured size to the band t0 is held to below (the
    # device's step at least, the device's plus twice the mean overhead at most), 15% either way.
    step_bounds = {
        batch: (
            0.85 * 1000 * truth.seconds(batch),
            1.15 * (1000 * truth.seconds(batch) + 2 * calibration.overhead_ms),
        )
        for batch in sizes
    }
    steps_out_of_bounds = {
        batch: (round(fitted_step_ms(batch), 3), bounds)
        for batch, bounds in step_bounds.items()
        if not bounds[0] <= fitted_step_ms(batch) <= bounds[1]
    }
    # t0 trades off against c, and c against alpha: under load a fit split 5.4 ms at batch 1
    # into t0 4.9 and growth 0.47 (truth 0.35), within 7% of the step but 34% of its growth.
    # What grows with the batch is held to 15% where it is at least the fixed cost (the batches
    # that the queue-delay advice is about), and alpha to 15%.
    growth_errors = {batch: fitted_growth_ms(batch) / true_growth_ms(batch) - 1 for batch in sizes}
    dominant = [batch for batch in sizes if true_growth_ms(batch) >= truth.base_ms]
    shown = ", ".join(
        f"{batch}: {fitted_step_ms(batch):.2f} in {low:.2f}-{high:.2f}"
        for batch, (low, high) in step_bounds.items()
    )
    print(f"step ms by batch size, fitted in bounds: {shown}")
    print(
        "growth error by batch size: "
        + ", ".join(f"{b}: {e:+.1%}" for b, e in growth_errors.items())
    )
    assert not steps_out_of_bounds, steps_out_of_bounds
    assert dominant, f"no batch size measured where the growth is the fixed cost or more: {sizes}"
    assert all(abs(growth_errors[batch]) <= 0.15 for batch in dominant), growth_errors
    assert fitted["alpha"] == pytest.approx(truth.exponent, rel=0.15)
    # The fixed cost is the device's plus what the Python backend spends around it, whose
    # measured mean the machine's load moves (0.6 to 0.8 ms per execution here with the test
    # alone and a core busy, 1.0 to 1.6 in busy suite runs): it lies between the device's and
    # the device's plus twice that mean.
    assert truth.base_ms < fitted["t0Ms"] < truth.base_ms + 2 * calibration.overhead_ms
    assert fitted["rSquared"] > 0.95
    assert len(fitted["batchSizes"]) >= 8
    assert fitted["span"] >= 64


def policy(*, autotune: bool) -> specs.BatchPolicySpec:
    return make_spec(
        target={"selector": {"matchLabels": {"app": "triton"}}, "models": [GPU_SIM]},
        profiles={
            "bulk": {"maxQueueDelayMicroseconds": STATIC_DELAY_US, "preferredBatchSizes": [64, 128]}
        },
        defaultProfile="bulk",
        slo={
            "p95LatencyMs": SLO_P95_MS,
            "autotune": autotune,
            "minQueueDelayMicroseconds": 100,
            "maxQueueDelayMicroseconds": 100_000,
        },
    )


def runner_for(
    server: local_triton.LocalTriton, sidecar_url: str, spec: specs.BatchPolicySpec
) -> running.Runner:
    triton = servers.TritonServer(server.http_url)
    return running.Runner(
        name="slo",
        spec=spec,
        triton_servers=[triton],
        source=sidecars.SidecarSource([sidecar_url], models=[GPU_SIM], slo=spec.slo),
        metrics=telemetry.controller_metrics(),
    )


async def close(runner: running.Runner) -> None:
    await runner.close()


def delay_of(report: running.TickReport) -> int:
    delay: int = report.decision.settings.dynamic_batching["max_queue_delay_microseconds"]
    return delay


@pytest.mark.timeout(150)
async def test_the_recommended_delay_meets_the_slo_where_static_bulk_does_not(
    server: local_triton.LocalTriton, calibration: Calibration
) -> None:
    static_runner = runner_for(server, calibration.sidecar_url, policy(autotune=False))
    tuned_runner = runner_for(server, calibration.sidecar_url, policy(autotune=True))
    try:
        static_report = await static_runner.tick()
        assert static_report.outcomes[0].state == "Updated"
        assert delay_of(static_report) == STATIC_DELAY_US
        static = await measured_load(server, MEASURE_SECONDS)

        # Autotune reads the sidecar while the load runs, as it would in production; the
        # reload it causes falls outside the measured run.
        settling = asyncio.create_task(steady_load(server, 6.0))
        await asyncio.sleep(5.0)
        tuned_report = await tuned_runner.tick()
        await settling
        recommended = tuned_report.reading.signals.metrics["recommendedQueueDelayMicroseconds"]
        tuned_delay = delay_of(tuned_report)
        assert tuned_report.outcomes[0].reloads == 1
        tuned = await measured_load(server, MEASURE_SECONDS)
        status = get_json(f"{calibration.sidecar_url}/status?sloP95Ms={SLO_P95_MS:g}")
    finally:
        await close(static_runner)
        await close(tuned_runner)

    delay = status["models"][GPU_SIM]["recommendation"]["queueDelay"]
    print(
        f"\nSLO p95 {SLO_P95_MS:g} ms at {RATE:g} req/s: static bulk (100 ms delay) p95 "
        f"{static.load.latency_p95_ms:.1f} ms, {static.mean_queue_ms:.1f} ms queued; recommended "
        f"delay {recommended:.0f} us (applied {tuned_delay} us, expected batch "
        f"{delay['expectedBatchSize']:.1f}) p95 {tuned.load.latency_p95_ms:.1f} ms, "
        f"{tuned.mean_queue_ms:.1f} ms queued; p50 {static.load.latency_p50_ms:.1f} -> "
        f"{tuned.load.latency_p50_ms:.1f} ms"
    )
    assert static.load.failed == tuned.load.failed == 0
    assert tuned_delay == round(recommended)
    # What the recommendation promises: its delay, the fitted step of the batch it expects and
    # the margin add up to the objective.
    assert delay["meetsObjective"]
    planned_ms = delay["microseconds"] / 1000 + delay["stepMs"] + delay["marginMs"]
    assert planned_ms == pytest.approx(SLO_P95_MS, abs=1.0)
    # What the server does with it: the static delay alone is past the objective, and the time
    # requests wait in Triton's queue, which the delay decides, shrinks with it (a request waits
    # about half the delay on average, so about half of the delay removed comes off; the test
    # asks for a quarter). Whether the client's p95 lands within the objective also depends on
    # how busy this machine is: printed above, not asserted.
    assert static.load.latency_p95_ms is not None
    assert static.load.latency_p95_ms > SLO_P95_MS
    removed_ms = (STATIC_DELAY_US - tuned_delay) / 1000
    assert tuned.mean_queue_ms <= static.mean_queue_ms - 0.25 * removed_ms


@pytest.mark.timeout(150)
def test_the_runner_command_autotunes_from_a_sidecar(
    server: local_triton.LocalTriton, calibration: Calibration, tmp_path: Path
) -> None:
    runner = run_command_until(
        "apiVersion: batchpilot.dev/v1alpha1\nkind: BatchPolicy\nmetadata: {name: tuned}\n"
        "spec:\n  target: {selector: {matchLabels: {app: triton}}, models: [gpu_sim]}\n"
        "  profiles: {bulk: {maxQueueDelayMicroseconds: 100000}}\n"
        "  defaultProfile: bulk\n  load: {source: sidecar}\n"
        "  slo: {p95LatencyMs: 30, autotune: true, minQueueDelayMicroseconds: 100,"
        " maxQueueDelayMicroseconds: 100000}\n",
        ["--triton", server.http_url, "--sidecar", calibration.sidecar_url],
        tmp_path,
        until="applied bulk to gpu_sim",
    )
    output, metrics = runner.output, runner.metrics
    assert runner.returncode == 0, output
    assert f"signals from sidecars {calibration.sidecar_url}" in output
    found = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    recommended = found[
        (
            "batchpilot_signal",
            (
                ("metric", "recommendedQueueDelayMicroseconds"),
                ("policy", "tuned"),
                ("policy_namespace", ""),
            ),
        )
    ]
    # A policy file without metadata.namespace: its series carry an empty policy_namespace.
    applied = found[
        ("batchpilot_queue_delay_microseconds", (("policy", "tuned"), ("policy_namespace", "")))
    ]
    # An idle model makes batches of one: the delay is what the objective leaves after one step.
    assert 100 <= applied == round(recommended) < 30_000
