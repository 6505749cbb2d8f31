"""One run of the GPU check: Triton, the sidecar and the runner for real, under load.

A tritonserver from the nvidia-pytriton wheel serves `torch_mlp` (the project's own model, its
weights drawn from a seed) with the device and size this run gives it; a sidecar process reads
Triton and, through NVML, the GPUs; the standalone runner's engine (`batchpilot.running.Runner`)
applies the policy's profiles. The load is open-loop Poisson at one rate throughout, and the
profile alternates interactive, bulk, interactive, ... every segment, set as a manual override
(what `kubectl patch` would do to a BatchPolicy), so the profiles are compared under the same
load and every switch happens under it. The runner is ticked from here rather than from its own
loop, so that a switch's request and its reload are timed exactly.

While it runs, the sidecar's /status is sampled twice a second for NVML's utilization, Triton's
metrics are read at every switch, and every request is recorded; `accounting` turns those into
the figures, `render` into text. With `device="cpu"` the same run exercises everything but CUDA
and NVML, which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from batchpilot import running, telemetry
from batchpilot.api import documents, names, v1alpha1
from batchpilot.api.v1alpha1 import specs
from batchpilot.signals import sidecars
from batchpilot_harness import loadgen, local_triton
from batchpilot_harness.gpuchecks import accounting, devices, plans
from batchpilot_harness.gpuchecks.findings import Comparison, Findings
from batchpilot_triton import reports, scraping, servers

MODEL = plans.MODEL
POLICY_NAME = "gpu-check"
PROFILES: dict[str, dict[str, Any]] = {
    "interactive": {"maxQueueDelayMicroseconds": 500, "preferredBatchSizes": [4, 8]},
    "bulk": {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]},
}
_LIVE_EVERY_SECONDS = 5.0


def policy_document() -> dict[str, Any]:
    return {
        "apiVersion": v1alpha1.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "target": {"selector": {"matchLabels": {"app": "triton"}}, "models": [MODEL]},
            "profiles": PROFILES,
            "defaultProfile": "interactive",
        },
    }


def model_config(base: str, plan: plans.Plan) -> str:
    """torch_mlp's config.pbtxt with the parameters its model.py reads for device and size."""
    values = {
        # Triton sees only the chosen GPU (CUDA_VISIBLE_DEVICES), as its first.
        "device": "cuda" if plan.device == "cuda" else "cpu",
        "hidden_width": str(plan.hidden_width),
        "hidden_layers": str(plan.hidden_layers),
    }
    entries = "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        for key, value in values.items()
    )
    return f"{base.rstrip()}\n# Set by the GPU check (batchpilot_harness.gpuchecks).\n{entries}"


def build_repository(plan: plans.Plan, where: Path) -> Path:
    repository = where / "model-repository"
    shutil.copytree(
        plan.model_repository / MODEL,
        repository / MODEL,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    config = repository / MODEL / "config.pbtxt"
    config.write_text(model_config(config.read_text(), plan))
    return repository


def server_environment(plan: plans.Plan) -> dict[str, str]:
    if plan.device == "cpu":
        return {}
    # PCI bus order is NVML's, so the sidecar's GPU index and CUDA's name the same board.
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(plan.gpu)}


# -- what a run finds -----------------------------------------------------------------------------


# -- the processes --------------------------------------------------------------------------------


@contextlib.contextmanager
def sidecar_process(
    triton: local_triton.LocalTriton, log: Path, *, interval: float
) -> Iterator[str]:
    """`python -m batchpilot_sidecar` for `triton`, with the real NVML path; yields its URL."""
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "batchpilot_sidecar",
        f"--triton-url={triton.http_url}",
        f"--metrics-url={triton.metrics_url}",
        f"--listen=127.0.0.1:{port}",
        f"--interval={interval:g}",
        "--rate-window=5",
    ]
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)  # noqa: S603
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the sidecar exited with {process.returncode}: {_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1):  # noqa: S310 -- ours
                    break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar did not come up: {_tail(log)}") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(log: Path, size: int = 2000) -> str:
    return log.read_text(errors="replace")[-size:] if log.exists() else ""


def run(plan: plans.Plan, out: Callable[[str], None] = print) -> Findings:
    """Start everything, measure, stop everything; the figures come back as Findings."""
    plan.out.mkdir(parents=True, exist_ok=True)
    for previous in ("model-repository", "triton"):
        shutil.rmtree(plan.out / previous, ignore_errors=True)
    repository = build_repository(plan, plan.out)
    triton = local_triton.LocalTriton(
        model_repository=repository,
        models=[MODEL],
        run_directory=plan.out / "triton",
        environment=server_environment(plan),
        exit_timeout_seconds=5,
    )
    out(f"Starting tritonserver with {plan.describe()} ...")
    try:
        triton.start()
        startup = triton.wait_ready(plan.ready_timeout)
        out(f"Triton ready in {startup:.1f} s; log: {triton.log_path}")
        with sidecar_process(
            triton, plan.out / "sidecar.log", interval=plan.sample_seconds
        ) as sidecar_url:
            out(f"Sidecar at {sidecar_url}; log: {plan.out / 'sidecar.log'}")
            try:
                return asyncio.run(_measure(plan, triton, sidecar_url, startup, out))
            except (aiohttp.ClientError, OSError, TimeoutError, servers.TritonError) as error:
                # Said as the run's verdict, never a traceback: the last line must say why.
                raise RuntimeError(_broke_off(error, triton)) from None
    except local_triton.LocalTritonError as error:
        raise RuntimeError(str(error)) from None
    finally:
        triton.stop()


def _broke_off(error: BaseException, triton: local_triton.LocalTriton) -> str:
    """Why the measurement stopped part-way, and whether tritonserver is still there."""
    said = f"the measurement broke off: {type(error).__name__}: {error}".rstrip(": ")
    status = triton.exit_status
    if status is None:
        return f"{said} (tritonserver still runs; its log: {triton.log_path})"
    lines = [" ".join(line.split()) for line in triton.log_tail(4000).splitlines()]
    tail = " | ".join([line for line in lines if line.strip("|+- ")][-8:])
    return f"{said}; tritonserver exited with status {status}; its log ends: {tail}"


# -- measuring ------------------------------------------------------------------------------------


class _Sidecar:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self._session = session
        self._url = url

    async def status(self) -> reports.StatusDocument:
        async with self._session.get(f"{self._url}/status") as response:
            response.raise_for_status()
            return sidecars.STATUS_DOCUMENT.validate_json(await response.read())


def _device(status: reports.StatusDocument, index: int) -> reports.DeviceReport | None:
    return next((d for d in status.gpu.devices if d.index == index), None)


def _gpu_line(status: reports.StatusDocument) -> str:
    gpu = status.gpu
    return f"{gpu.status} via {gpu.source}" if gpu.source else f"{gpu.status}: {gpu.reason}"


async def _compare(sidecar: _Sidecar, moment: str) -> Comparison:
    status = await sidecar.status()
    smi: Sequence[devices.SmiReading] = ()
    problem = None
    try:
        smi = devices.parse_smi_csv(await asyncio.to_thread(devices.run_smi))
    except devices.SmiUnavailable as error:
        problem = str(error)
    except ValueError as error:
        problem = f"nvidia-smi's output could not be read: {error}"
    return Comparison(
        moment=moment,
        gpus=devices.compare(status.gpu.devices, smi),
        sidecar_gpu=_gpu_line(status),
        smi_problem=problem,
    )


async def _snapshot(server: servers.TritonServer, clock: Callable[[], float]) -> scraping.Snapshot:
    text = await server.metrics_text()
    return scraping.parse(text, taken_at=clock())


async def _switch(
    runner: running.Runner,
    base: specs.BatchPolicySpec,
    profile: str,
    *,
    previous: str | None,
    clock: Callable[[], float],
) -> accounting.Switch:
    """Override the policy to `profile` and tick the runner once: it decides and applies."""
    override = specs.Override(profile=profile, reason="gpu check")
    runner.spec = base.model_copy(update={"override": override})
    asked = clock()
    report = await runner.tick()
    served = clock()
    reloads = tuple(
        applied.seconds
        for outcome in report.outcomes
        for applied in outcome.applied
        if applied.reloaded
    )
    failures = [f"{o.replica.title}: {o.message}" for o in report.outcomes if o.error]
    if report.decision.profile != profile:
        failures.append(f"the runner decided {report.decision.profile}, not {profile}")
    return accounting.Switch(
        profile=profile,
        previous=previous,
        asked_at=asked,
        served_at=served,
        reload_seconds=reloads,
        error="; ".join(failures) or None,
    )


@dataclasses.dataclass
class _Observed:
    requests: list[accounting.Request] = dataclasses.field(default_factory=list)
    samples: list[accounting.Sample] = dataclasses.field(default_factory=list)
    switches: list[accounting.Switch] = dataclasses.field(default_factory=list)
    snapshots: list[scraping.Snapshot] = dataclasses.field(default_factory=list)
    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    last_status: reports.StatusDocument | None = None
    sent: int = 0


async def _measure(
    plan: plans.Plan,
    triton: local_triton.LocalTriton,
    sidecar_url: str,
    startup: float,
    out: Callable[[str], None],
) -> Findings:
    loop = asyncio.get_running_loop()
    clock = loop.time
    server = servers.TritonServer(triton.http_url, metrics_url=triton.metrics_url)
    base = documents.parse_document(policy_document())
    runner = running.Runner(
        name=POLICY_NAME,
        spec=base,
        triton_servers=[server],
        source=sidecars.SidecarSource([sidecar_url], models=[MODEL], slo=None),
        metrics=telemetry.controller_metrics(),
    )
    seen = _Observed()
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            sidecar = _Sidecar(session, sidecar_url)
            initial = await _switch(runner, base, plan.profiles[0], previous=None, clock=clock)
            out(f"Applied {initial.profile} before the load ({_reloads(initial)})")
            await asyncio.sleep(2 * plan.sample_seconds)  # a fresh GPU reading
            seen.comparisons.append(await _compare(sidecar, "idle"))
            payload = await loadgen.payload_from_metadata(session, triton.http_url, MODEL)
            started = clock()
            seen.snapshots.append(await _snapshot(server, clock))
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample(sidecar, plan, seen, stop, clock))
            load: asyncio.Task[loadgen.LoadResult] = asyncio.create_task(
                loadgen.run_load(
                    base_url=triton.http_url,
                    payload=payload,
                    phases=[loadgen.Phase(rate=plan.rate, seconds=plan.load_seconds)],
                    seed=plan.seed,
                    on_record=lambda record: _record(record, seen, clock),
                )
            )
            try:
                await _drive(plan, runner, base, server, sidecar, seen, started, clock, out)
                seen.sent = len((await load).records)
            finally:
                stop.set()
                await sampler
                if not load.done():
                    load.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
            ended = clock()
            seen.snapshots.append(await _snapshot(server, clock))
            final = await sidecar.status()
    finally:
        await runner.close()
    return _findings(plan, startup, initial, seen, final, started, ended)


def _record(record: loadgen.RequestRecord, seen: _Observed, clock: Callable[[], float]) -> None:
    done = clock()
    latency = record.latency if record.sent is not None else None
    seen.requests.append(
        accounting.Request(
            sent=done - latency if latency is not None else done,
            latency=latency,
            succeeded=record.succeeded,
            error=record.error,
        )
    )


async def _sample(
    sidecar: _Sidecar,
    plan: plans.Plan,
    seen: _Observed,
    stop: asyncio.Event,
    clock: Callable[[], float],
) -> None:
    while not stop.is_set():
        try:
            status = await sidecar.status()
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            seen.samples.append(accounting.Sample(at=clock(), utilization=None))
            print(f"  (the sidecar's /status could not be read: {error})", file=sys.stderr)
        else:
            device = _device(status, plan.gpu)
            utilization = device.utilization if device is not None else None
            seen.samples.append(accounting.Sample(at=clock(), utilization=utilization))
            seen.last_status = status
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=plan.sample_seconds)


async def _drive(
    plan: plans.Plan,
    runner: running.Runner,
    base: specs.BatchPolicySpec,
    server: servers.TritonServer,
    sidecar: _Sidecar,
    seen: _Observed,
    started: float,
    clock: Callable[[], float],
    out: Callable[[str], None],
) -> None:
    profiles = plan.profiles
    compare_at: float | None = started + plan.load_seconds - plan.segment_seconds / 2
    next_line = started + _LIVE_EVERY_SECONDS
    for index, profile in enumerate(profiles):
        if index > 0:
            switch = await _switch(runner, base, profile, previous=profiles[index - 1], clock=clock)
            seen.switches.append(switch)
            seen.snapshots.append(await _snapshot(server, clock))
            out(f"  +{switch.asked_at - started:4.0f}s  switched to {profile}: {_reloads(switch)}")
        segment_ends = started + (index + 1) * plan.segment_seconds
        while (now := clock()) < segment_ends:
            wake = min(now + plan.tick_seconds, segment_ends)
            if compare_at is not None:
                wake = min(wake, max(compare_at, now))
            await asyncio.sleep(wake - now)
            if compare_at is not None and clock() >= compare_at:
                # Halfway through the last segment: the readings of a GPU under steady load.
                seen.comparisons.append(await _compare(sidecar, f"under load ({profile})"))
                compare_at = None
                continue
            if clock() >= segment_ends:
                break
            await runner.tick()
            if clock() >= next_line:
                out(_live_line(seen, profile, started, clock()))
                next_line += _LIVE_EVERY_SECONDS


def _reloads(switch: accounting.Switch) -> str:
    if switch.error:
        return f"FAILED: {switch.error}"
    reloads = ", ".join(f"{seconds:.2f} s" for seconds in switch.reload_seconds) or "no reload"
    return f"reload {reloads}, {switch.served_at - switch.asked_at:.2f} s from asking to serving"


def _live_line(seen: _Observed, profile: str, started: float, now: float) -> str:
    recent = [r for r in seen.requests if r.done >= now - _LIVE_EVERY_SECONDS]
    figures = accounting.latencies(recent)
    p99 = f"{figures.p99_ms:.1f}" if figures.p99_ms is not None else "-"
    device = None
    if seen.samples and seen.samples[-1].utilization is not None:
        device = seen.samples[-1].utilization
    utilization = f"{100 * device:3.0f}%" if device is not None else "  -"
    return (
        f"  +{now - started:4.0f}s  {profile:<12} {len(recent) / _LIVE_EVERY_SECONDS:6.0f} req/s  "
        f"p99 {p99:>7} ms  failed {figures.failed}  GPU {utilization}"
    )


def _findings(
    plan: plans.Plan,
    startup: float,
    initial: accounting.Switch,
    seen: _Observed,
    final: reports.StatusDocument,
    started: float,
    ended: float,
) -> Findings:
    switches = [initial, *seen.switches]
    found = accounting.stretches(switches, start=started, end=ended)
    counted = accounting.counters_by_stretch(found, seen.snapshots, MODEL)
    problems = [
        f"switch to {switch.profile}: {switch.error}" for switch in switches if switch.error
    ]
    if plan.device == "cuda":
        if final.gpu.status != "available" or final.gpu.source != "nvml":
            problems.append(f"the sidecar did not read the GPU through NVML: {_gpu_line(final)}")
        elif not any(sample.utilization is not None for sample in seen.samples):
            problems.append(f"the sidecar reported no utilization for GPU {plan.gpu}")
    model = final.models.get(MODEL)
    if model is None:
        problems.append(f"the sidecar's /status has no {MODEL}")
    return Findings(
        plan=plan.describe(),
        device=plan.device,
        gpu=plan.gpu,
        startup_seconds=startup,
        comparisons=tuple(seen.comparisons),
        step_time=model.step_time if model else None,
        initial=initial,
        switches=accounting.switch_accounts(seen.switches, seen.requests),
        profiles=accounting.profile_accounts(
            switches=switches,
            requests=seen.requests,
            samples=seen.samples,
            counted=counted,
            start=started,
            end=ended,
        ),
        sent=seen.sent,
        all_requests=accounting.latencies(seen.requests),
        failures=accounting.failure_kinds(seen.requests),
        samples=len(seen.samples),
        problems=tuple(problems),
    )


# -- the report -----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _figure(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(findings: Findings) -> str:
    lines = [f"GPU check: {findings.plan}", ""]
    for comparison in findings.comparisons:
        lines.append(f"NVML (the sidecar's /status) next to nvidia-smi, {comparison.moment}:")
        lines.append(f"  sidecar GPU: {comparison.sidecar_gpu}")
        if comparison.smi_problem:
            lines.append(f"  nvidia-smi: {comparison.smi_problem}")
        lines += [devices.render(comparison.gpus), ""]
    lines += [_step_time(findings.step_time), ""]
    lines.append(f"Before the load: {findings.initial.profile}, {_reloads(findings.initial)}.")
    lines.append("Switches under load (the runner's applies; requests sent from the ask until")
    lines.append(f"{accounting.SWITCH_TAIL_SECONDS:g} s after the reload):")
    lines.append(
        f"  {'to':<12} {'reload s':>9} {'ask->serve s':>13} {'requests':>9} {'failed':>7} "
        f"{'p99 ms':>8} {'max ms':>8}"
    )
    for moment in findings.switches:
        switch = moment.switch
        reload = "+".join(f"{s:.2f}" for s in switch.reload_seconds) or "none"
        lines.append(
            f"  {switch.profile:<12} {reload:>9} {moment.decision_to_served_seconds:13.2f} "
            f"{moment.requests.requests:9d} {moment.requests.failed:7d} "
            f"{_ms(moment.requests.p99_ms):>8} {_ms(moment.requests.max_ms):>8}"
            + (f"  FAILED: {switch.error}" if switch.error else "")
        )
    lines += ["", "Per profile (device-seconds from NVML's utilization integrated over the"]
    lines.append("profile's time; the model's timer is its own clock around each batch):")
    lines.append(
        f"  {'profile':<12} {'seconds':>7} {'served':>7} {'failed':>6} {'steady p50':>10} "
        f"{'steady p99':>10} {'switch p99':>10} {'avg batch':>9} {'GPU busy':>8} "
        f"{'device-s/1k':>11} {'timer-s/1k':>10}"
    )
    for account in findings.profiles:
        batch = account.counted.average_batch_size
        busy = account.utilization
        lines.append(
            f"  {account.profile:<12} {account.seconds:7.1f} {account.served:7d} "
            f"{account.failed:6d} "
            f"{_ms(account.steady.p50_ms):>10} {_ms(account.steady.p99_ms):>10} "
            f"{_ms(account.switching.p99_ms):>10} {_figure(batch, 1):>9} "
            f"{(f'{100 * busy:.1f}%' if busy is not None else '-'):>8} "
            f"{_figure(account.device_seconds_per_1000):>11} "
            f"{_figure(account.timer_seconds_per_1000):>10}"
        )
    total = findings.all_requests
    lines += [
        "",
        f"All requests: {findings.sent} sent, {total.requests} answered or failed, "
        f"{total.failed} failed; p50 {_ms(total.p50_ms)} ms, "
        f"p99 {_ms(total.p99_ms)} ms, max {_ms(total.max_ms)} ms; Triton ready in "
        f"{findings.startup_seconds:.1f} s; {findings.samples} utilization samples.",
    ]
    lines += [f"  failed: {kind}" for kind in findings.failures]
    return "\n".join(lines)


def _step_time(fit: reports.StepTimeReport | None) -> str:
    head = "Step time fitted by the sidecar, t_step(b) = t0 + c * b^alpha:"
    if fit is None:
        return f"{head} no report"
    if fit.status != "fitted":
        return f"{head} {fit.status}: {fit.reason}"
    sizes = fit.batch_sizes
    span = f"{len(sizes)} batch sizes {min(sizes)}-{max(sizes)}" if sizes else "no batch sizes"
    return (
        f"{head}\n  t0 {_figure(fit.t0_ms)} ms, c {_figure(fit.c_ms)} ms, alpha "
        f"{_figure(fit.alpha, 2)}, R^2 {_figure(fit.r_squared)}, RMSE {_figure(fit.rmse_ms)} ms "
        f"({span}, {fit.observations} observations, {fit.executions} executions)"
    )


def write(findings: Findings, out: Path) -> None:
    (out / "gpu-check.txt").write_text(render(findings) + "\n")
    data = json.dumps(dataclasses.asdict(findings), indent=2, default=str)
    (out / "gpu-check.json").write_text(data + "\n")
