"""A real tritonserver with its sidecar and the standalone runner, scraped by a real Prometheus:
what the dashboard and the alerts are read from, for the tests that check them.

The runner exports the operator's metric families (one dashboard serves both), so it stands in
for the operator. No GPU exists on the machines this runs on: the sidecar reads GPU numbers from
a DCGM-exporter page that `EmulatedDcgmExporter` serves for gpu_sim's emulated device
(utilization from its busy-seconds counters; the memory figures are a fixed footprint), through
the sidecar's real DCGM code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_charts import queries
from batchpilot_harness import demo_models, loadgen, local_triton
from prometheus_fixtures import PrometheusServer, ScrapeTarget, StartPrometheus
from triton_fixtures import TritonFactory

GPU_SIM = demo_models.GPU_SIM
BUSY_SECONDS = "emulated_device_busy_seconds_total"
NAMESPACE = "trading"
"""The namespace label Prometheus gives the sidecar's series, and the policies' namespace (the
runner's series name it policy_namespace), as for an operator's policy beside its Pods."""

# Interactive batching while quiet, bulk under a burst: the burst makes both profiles, a switch
# each way, reloads (apply latency) and a visible change of batch size and device load.
BURST_POLICY = f"""\
apiVersion: batchpilot.dev/v1alpha1
kind: BatchPolicy
metadata:
  name: desk
  namespace: {NAMESPACE}
spec:
  target:
    selector: {{matchLabels: {{app: triton}}}}
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
BURST = (
    loadgen.Phase(rate=100, seconds=15),
    loadgen.Phase(rate=450, seconds=20),
    loadgen.Phase(rate=100, seconds=20),
)


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


@dataclass(frozen=True)
class MonitoredTriton:
    server: local_triton.LocalTriton
    prometheus: PrometheusServer
    exporter: EmulatedDcgmExporter

    async def load(self, phases: Sequence[loadgen.Phase]) -> loadgen.LoadResult:
        """Open-loop Poisson load on gpu_sim, phase after phase."""
        payload = loadgen.InferencePayload.for_input(
            model=GPU_SIM, input_name="INPUT", datatype="FP32", shape=[1, 16]
        )
        return await loadgen.run_load(base_url=self.server.http_url, payload=payload, phases=phases)


@contextlib.asynccontextmanager
async def monitored_triton(
    triton_server: TritonFactory,
    prometheus_server: StartPrometheus,
    directory: Path,
    *,
    policy: str,
    slo_p95_ms: float,
    rule_files: Sequence[Path] = (),
) -> AsyncIterator[MonitoredTriton]:
    """tritonserver serving gpu_sim, its sidecar and `batchpilot run` with `policy` (a
    BatchPolicy document), all scraped every second by Prometheus (the sidecar as pod triton-0
    of namespace trading, the runner as the operator's job); stopped after the body."""
    server = triton_server(GPU_SIM)
    sidecar_port, runner_port = local_triton.free_ports("127.0.0.1", 2)
    sidecar_url = f"http://127.0.0.1:{sidecar_port}"
    policy_file = directory / "policy.yaml"
    policy_file.write_text(policy)
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
                "--slo-p95-ms", f"{slo_p95_ms:g}",
            ],
            log=directory / "sidecar.log",
            health=f"{sidecar_url}/healthz",
        )  # fmt: skip
        runner = child(
            [
                "-m", "batchpilot", "run",
                "--policy", str(policy_file),
                "--triton", server.http_url,
                "--triton-metrics", server.metrics_url,
                "--sidecar", sidecar_url,
                "--interval", "1",
                "--listen", f"127.0.0.1:{runner_port}",
            ],
            log=directory / "runner.log",
            health=f"http://127.0.0.1:{runner_port}/healthz",
        )  # fmt: skip
        async with sidecar, runner:
            prometheus = prometheus_server(
                [
                    ScrapeTarget(
                        address=f"127.0.0.1:{sidecar_port}",
                        labels={
                            "job": queries.SIDECAR_JOB,
                            "namespace": NAMESPACE,
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
                rule_files=rule_files,
            )
            yield MonitoredTriton(server=server, prometheus=prometheus, exporter=exporter)


def prometheus_get(url: str, path: str, **parameters: str) -> Any:
    query = urllib.parse.urlencode(parameters)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "success", answer
    return answer["data"]


def finite_values(matrix: Sequence[Mapping[str, Any]]) -> list[float]:
    values = (float(value) for series in matrix for _, value in series["values"])
    return [value for value in values if math.isfinite(value)]
