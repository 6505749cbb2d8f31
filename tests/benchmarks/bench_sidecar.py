"""The sidecar's own cost: CPU and resident memory while it reads ten models once a second.

A real tritonserver serves ten copies of gpu_sim under different names (one instance each, to
keep the server light on a small machine), open-loop load keeps every model busy with batches of
several sizes (so every model has statistics, rates and a step-time fit to keep), and a
`batchpilot sidecar` child process reads them at 1 Hz. CPU time and RSS come from the sidecar's
/proc entries; /status and /metrics are fetched once a second, as a scraper and a runner would.

    python tests/benchmarks/bench_sidecar.py            # 60 s measured
    python tests/benchmarks/bench_sidecar.py --short    # 10 s, for CI: asserts nothing about speed
    python tests/benchmarks/bench_sidecar.py --entry module   # as `python -m batchpilot_sidecar`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from batchpilot_harness import demo_models, loadgen, local_sidecar, local_triton, procfs

MODELS = [f"gpu_sim_{i}" for i in range(10)]
WARM_UP_SECONDS = 8.0


def model_repository(root: Path) -> Path:
    """Ten renamed copies of gpu_sim, one instance each."""
    repository = root / "models"
    source = demo_models.MODEL_REPOSITORY / demo_models.GPU_SIM
    for name in MODELS:
        shutil.copytree(source, repository / name, ignore=shutil.ignore_patterns("__pycache__"))
        config = repository / name / "config.pbtxt"
        text = config.read_text(encoding="utf-8")
        text = text.replace('name: "gpu_sim"', f'name: "{name}"').replace("count: 4", "count: 1")
        config.write_text(text, encoding="utf-8")
    return repository


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body


@dataclass(frozen=True)
class Measurement:
    seconds: float
    cpu_seconds: float
    rss_start: int
    rss_end: int
    rss_peak: int
    status_bytes: int
    metrics_bytes: int
    fitted: int
    tracked: int

    def report(self) -> str:
        mib = 1024 * 1024
        return (
            f"sidecar reading {len(MODELS)} models at 1 Hz for {self.seconds:.0f} s: "
            f"CPU {self.cpu_seconds / self.seconds:.3f} CPU-seconds per second "
            f"({100 * self.cpu_seconds / self.seconds:.1f}% of one core); RSS "
            f"{self.rss_start / mib:.1f} MiB at start of measurement, {self.rss_end / mib:.1f} MiB "
            f"at end, {self.rss_peak / mib:.1f} MiB peak; {self.tracked} models tracked, "
            f"{self.fitted} fitted; /status {self.status_bytes / 1024:.0f} KiB, /metrics "
            f"{self.metrics_bytes / 1024:.0f} KiB"
        )


async def load(server: local_triton.LocalTriton, seconds: float) -> None:
    """Every model gets requests of 1, 4, 16 and 64 items, a few per second each: batches of
    several sizes, enough for a step-time fit."""
    runs = []
    for index, model in enumerate(MODELS):
        for items in (1, 4, 16, 64):
            payload = loadgen.InferencePayload.for_input(
                model=model, input_name="INPUT", datatype="FP32", shape=[items, 16]
            )
            runs.append(
                loadgen.run_load(
                    base_url=server.http_url,
                    payload=payload,
                    phases=[loadgen.Phase(rate=3, seconds=seconds)],
                    seed=100 * index + items,
                )
            )
    await asyncio.gather(*runs)


async def measure(sidecar: str, pid: int, seconds: float) -> Measurement:
    rss_start, cpu_start, started = (
        procfs.resident_bytes(pid),
        procfs.cpu_seconds(pid),
        time.monotonic(),
    )
    peak = rss_start
    status = metrics = b""
    while time.monotonic() - started < seconds:
        await asyncio.sleep(1.0)
        status = await asyncio.to_thread(fetch, f"{sidecar}/status?sloP95Ms=50")
        metrics = await asyncio.to_thread(fetch, f"{sidecar}/metrics")
        peak = max(peak, procfs.resident_bytes(pid))
    elapsed = time.monotonic() - started
    cpu = procfs.cpu_seconds(pid) - cpu_start
    models = json.loads(status)["models"]
    return Measurement(
        seconds=elapsed,
        cpu_seconds=cpu,
        rss_start=rss_start,
        rss_end=procfs.resident_bytes(pid),
        rss_peak=peak,
        status_bytes=len(status),
        metrics_bytes=len(metrics),
        fitted=sum(model["stepTime"]["status"] == "fitted" for model in models.values()),
        tracked=len(models),
    )


ENTRIES = {
    "batchpilot": ["-m", "batchpilot", "sidecar"],
    "module": ["-m", "batchpilot_sidecar"],
}


async def drive(
    server: local_triton.LocalTriton, sidecar: str, pid: int, seconds: float
) -> Measurement:
    traffic = asyncio.create_task(load(server, WARM_UP_SECONDS + seconds + 2))
    await asyncio.sleep(WARM_UP_SECONDS)
    measured = await measure(sidecar, pid, seconds)
    await traffic
    return measured


def benchmark(seconds: float, entry: str) -> Measurement:
    with tempfile.TemporaryDirectory(prefix="batchpilot-bench-") as root:
        repository = model_repository(Path(root))
        with local_triton.LocalTriton(
            model_repository=repository, models=MODELS, run_directory=Path(root) / "run"
        ) as server:
            with local_sidecar.running(
                server, "--interval", "1", command=ENTRIES[entry]
            ) as sidecar:
                measured: Measurement = asyncio.run(
                    drive(server, sidecar.url, sidecar.process.pid, seconds)
                )
            if sidecar.process.returncode != 0:
                raise RuntimeError(f"the sidecar exited with {sidecar.process.returncode}")
            return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="measure 10 s instead of 60 s")
    parser.add_argument("--seconds", type=float, help="seconds to measure")
    parser.add_argument(
        "--entry",
        choices=sorted(ENTRIES),
        default="batchpilot",
        help="run the sidecar as `batchpilot sidecar` or as `python -m batchpilot_sidecar`",
    )
    arguments = parser.parse_args(argv)
    seconds = arguments.seconds or (10.0 if arguments.short else 60.0)
    print(f"[{arguments.entry}] {benchmark(seconds, arguments.entry).report()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
