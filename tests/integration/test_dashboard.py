"""Every dashboard panel's queries return data from a real Prometheus scraping a real Triton's
sidecar and the standalone runner, and every alert rule evaluates against those series without
an error.

The runner exports the operator's metric families (one dashboard serves both), so it stands in
for the operator here. No GPU exists on the machines this runs on: the sidecar reads GPU numbers
from a DCGM-exporter page that this test serves for gpu_sim's emulated device (utilization from
its busy-seconds counters; the memory figures are a fixed footprint), through the sidecar's real
DCGM code path. With BATCHPILOT_DASHBOARD_PNG=path (`make dashboard-png`) the test also draws
the panels there, for the README.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

import dashboard_plots
from batchpilot_charts import alerts, dashboards, queries
from batchpilot_harness import demo_models, loadgen, local_triton
from prometheus_fixtures import ScrapeTarget, StartPrometheus
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "charts" / "batchpilot" / "files" / "alerts.yaml"
GPU_SIM = demo_models.GPU_SIM
PICTURE = "BATCHPILOT_DASHBOARD_PNG"
STEP = 1.0
"""Seconds between the points of the range queries (Prometheus scrapes every second)."""

# Interactive batching while quiet, bulk under a burst: the burst makes both profiles, a switch
# each way, reloads (apply latency) and a visible change of batch size and device load.
POLICY = f"""\
apiVersion: batchpilot.dev/v1alpha1
kind: BatchPolicy
metadata:
  name: desk
spec:
  target:
    selector: {{}}
    models: [{GPU_SIM}]
  profiles:
    interactive: {{maxQueueDelayMicroseconds: 1000, preferredBatchSizes: [4, 8]}}
    bulk: {{maxQueueDelayMicroseconds: 20000, preferredBatchSizes: [32, 64]}}
  defaultProfile: interactive
  load:
    rules: [{{profile: bulk, metric: requestRate, above: 250, below: 150, for: 3s}}]
  slo: {{p95LatencyMs: 50, profiles: [interactive]}}
  minDwellSeconds: 5
"""
PHASES = (
    loadgen.Phase(rate=100, seconds=15),
    loadgen.Phase(rate=450, seconds=20),
    loadgen.Phase(rate=100, seconds=20),
)
BUSY_SECONDS = "emulated_device_busy_seconds_total"
MIB = 2**20


class EmulatedDcgmExporter:
    """A DCGM exporter's page for one server's emulated device.

    Utilization is the share of wall time the device was busy between two reads of the page,
    from the model's busy-seconds counters (one series per stub: a reload starts new ones at
    zero, so increases are summed series by series).
    """

    def __init__(self, metrics_url: str) -> None:
        self.metrics_url = metrics_url
        self._busy: dict[tuple[tuple[str, str], ...], float] = {}
        self._read_at: float | None = None
        self.utilizations: list[float] = []

    async def _utilization(self, session: aiohttp.ClientSession) -> float | None:
        async with session.get(self.metrics_url) as response:
            text = await response.text()
        now = time.monotonic()
        busy = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != BUSY_SECONDS:
                    continue
                key = tuple(sorted(sample.labels.items()))
                busy += max(sample.value - self._busy.get(key, 0.0), 0.0)
                self._busy[key] = sample.value
        previous, self._read_at = self._read_at, now
        if previous is None:
            return None
        return min(busy / (now - previous), 1.0)

    async def page(self, request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as session:
            utilization = await self._utilization(session)
        labels = 'gpu="0",UUID="GPU-emulated-gpu-sim",modelName="emulated device (gpu_sim)"'
        lines = [
            f"DCGM_FI_DEV_FB_USED{{{labels}}} {2048}",
            f"DCGM_FI_DEV_FB_FREE{{{labels}}} {14336}",
        ]
        if utilization is not None:
            self.utilizations.append(utilization)
            lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} {100 * utilization:.1f}")
        return web.Response(text="\n".join(lines) + "\n")

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/metrics", self.page)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        (port,) = local_triton.free_ports("127.0.0.1", 1)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield f"http://127.0.0.1:{port}/metrics"
        finally:
            await runner.cleanup()


async def healthy(url: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response,
        ):
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


@contextlib.asynccontextmanager
async def child(argv: Sequence[str], *, log: Path, health: str) -> AsyncIterator[None]:
    """A batchpilot process, healthy before the body runs, stopped (SIGTERM) after it."""
    with log.open("w") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable, *argv, stdout=output, stderr=asyncio.subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while not await healthy(health):
            if process.returncode is not None or time.monotonic() > deadline:
                output_so_far = await asyncio.to_thread(log.read_text)
                pytest.fail(f"{' '.join(argv[:3])} did not come up: {output_so_far}")
            await asyncio.sleep(0.2)
        yield
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), timeout=20)


def prometheus_get(url: str, path: str, **parameters: str) -> Any:
    query = urllib.parse.urlencode(parameters)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "success", answer
    return answer["data"]


def finite_values(matrix: Sequence[Mapping[str, Any]]) -> list[float]:
    values = (float(value) for series in matrix for _, value in series["values"])
    return [value for value in values if math.isfinite(value)]


def by_time(matrix: Sequence[Mapping[str, Any]]) -> dict[float, float]:
    """The finite points of a single-series matrix (or of its series taken together), by time."""
    points = {float(at): float(value) for series in matrix for at, value in series["values"]}
    return {at: value for at, value in points.items() if math.isfinite(value)}


def report_figures(results: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> None:
    """The figures the README quotes: rate, batch size and device load in each profile."""
    in_force = {
        float(at): series["metric"]["profile"]
        for series in results["Active profile"][0]
        for at, value in series["values"]
        if float(value) == 1
    }
    rate = by_time(results["Request rate"][0])
    batch = by_time(results["Average batch size"][0])
    busy = by_time(results["GPU utilization"][0])
    for profile in ("interactive", "bulk"):
        burst = [at for at, value in rate.items() if value > 250 and in_force.get(at) == profile]
        loads = sorted(busy[at] for at in burst if at in busy)
        sizes = [batch[at] for at in burst if at in batch]
        if loads and sizes:
            peak = max(rate[at] for at in burst)
            print(
                f"{profile} under the burst: {len(burst)} s, up to {peak:.0f} requests/s, "
                f"batches {min(sizes):.1f}-{max(sizes):.1f}, device busy "
                f"{100 * loads[len(loads) // 2]:.0f}% (median), {100 * loads[-1]:.0f}% (max)"
            )
    print(
        f"requests/s up to {max(rate.values()):.0f}; average batch {min(batch.values()):.1f}"
        f"-{max(batch.values()):.1f}; device busy up to {100 * max(busy.values()):.0f}%"
    )


@pytest.mark.timeout(240)
async def test_every_dashboard_panel_query_returns_data(
    triton_server: TritonFactory, prometheus_server: StartPrometheus, tmp_path: Path
) -> None:
    server = triton_server(GPU_SIM)
    sidecar_port, runner_port = local_triton.free_ports("127.0.0.1", 2)
    sidecar_url = f"http://127.0.0.1:{sidecar_port}"
    policy = tmp_path / "desk.yaml"
    policy.write_text(POLICY)
    exporter = EmulatedDcgmExporter(server.metrics_url)
    async with exporter.serving() as dcgm_url:
        sidecar = child(
            [
                "-m", "batchpilot_sidecar",
                "--triton-url", server.http_url,
                "--metrics-url", server.metrics_url,
                "--listen", f"127.0.0.1:{sidecar_port}",
                "--interval", "1",
                "--rate-window", "5",
                "--dcgm-url", dcgm_url,
                "--slo-p95-ms", "50",
            ],
            log=tmp_path / "sidecar.log",
            health=f"{sidecar_url}/healthz",
        )  # fmt: skip
        runner = child(
            [
                "-m", "batchpilot", "run",
                "--policy", str(policy),
                "--triton", server.http_url,
                "--triton-metrics", server.metrics_url,
                "--sidecar", sidecar_url,
                "--interval", "1",
                "--listen", f"127.0.0.1:{runner_port}",
            ],
            log=tmp_path / "runner.log",
            health=f"http://127.0.0.1:{runner_port}/healthz",
        )  # fmt: skip
        async with sidecar, runner:
            prometheus = prometheus_server(
                [
                    ScrapeTarget(
                        address=f"127.0.0.1:{sidecar_port}",
                        labels={
                            "job": queries.SIDECAR_JOB,
                            "namespace": "trading",
                            "pod": "triton-0",
                        },
                    ),
                    ScrapeTarget(
                        address=f"127.0.0.1:{runner_port}",
                        labels={
                            "job": queries.OPERATOR_JOB,
                            "namespace": "batchpilot-system",
                            "pod": "batchpilot-operator-0",
                        },
                    ),
                ],
                rule_files=[ALERTS],
            )
            started = time.time()
            payload = loadgen.InferencePayload.for_input(
                model=GPU_SIM, input_name="INPUT", datatype="FP32", shape=[1, 16]
            )
            load = await loadgen.run_load(base_url=server.http_url, payload=payload, phases=PHASES)
            await asyncio.sleep(3)  # the last scrapes and rule evaluations
            ended = time.time()

    assert load.summary().failed == 0
    results: dict[str, list[list[Mapping[str, Any]]]] = {}
    for panel in dashboards.PANELS:
        results[panel.title] = []
        for query in panel.queries:
            expr = dashboards.instantiate(query.expr, rate_interval="10s")
            data = prometheus_get(
                prometheus.url,
                "/api/v1/query_range",
                query=expr,
                start=f"{started:.3f}",
                end=f"{ended:.3f}",
                step=f"{STEP:g}",
            )
            assert data["result"], f"{panel.title}: no series for {expr}"
            assert finite_values(data["result"]), f"{panel.title}: only NaN from {expr}"
            results[panel.title].append(data["result"])

    # The panels tell what happened: both profiles, a burst, batches that grew, a busy device.
    profiles = {
        series["metric"]["profile"]
        for series in results["Active profile"][0]
        if 1.0 in finite_values([series])
    }
    assert profiles == {"interactive", "bulk"}
    assert max(finite_values(results["Request rate"][0])) > 250
    assert max(finite_values(results["Average batch size"][0])) > 2
    utilization = finite_values(results["GPU utilization"][0])
    assert 0 < max(utilization) <= 1

    rules = prometheus_get(prometheus.url, "/api/v1/rules")["groups"]
    evaluated = {rule["name"]: rule for group in rules for rule in group["rules"]}
    assert set(evaluated) == {alert.name for alert in alerts.ALERTS}
    for name, rule in evaluated.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
    assert evaluated["BatchpilotOperatorDown"]["state"] == "inactive"

    report_figures(results)
    picture = os.environ.get(PICTURE)
    if picture:
        dashboard_plots.draw(
            results,
            start=started,
            step=STEP,
            path=Path(picture),
            title=(
                "batchpilot dashboard panels from a real Prometheus: tritonserver (CPU, gpu_sim), "
                "its sidecar and the standalone runner under a burst of load"
            ),
        )
