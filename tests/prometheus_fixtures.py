"""A real Prometheus server (Debian's `prometheus` package) for integration tests, and its
promtool.

`prometheus_server(targets)` starts one on a free loopback port with a 1 s scrape interval,
scraping the given `host:port` metrics endpoints with the given extra labels (a `job` label among
them replaces the default), evaluating the given rule files, and stops it at the end of the test;
`promtool` is the path of the package's rule checker. Tests that need either are skipped, saying
why, where the binary is missing (`make test` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest
import yaml

from batchpilot_harness import local_triton


@dataclass(frozen=True)
class ScrapeTarget:
    address: str
    """host:port"""
    labels: Mapping[str, str]
    path: str = "/metrics"


@dataclass(frozen=True)
class PrometheusServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


class StartPrometheus(Protocol):
    def __call__(
        self, targets: Sequence[ScrapeTarget], rule_files: Sequence[Path] = ()
    ) -> PrometheusServer: ...


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool (Debian package `prometheus`; `make test` installs it)")
    return found


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[StartPrometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian package `prometheus`; `make test` installs it)")
    started: list[PrometheusServer] = []

    def start(targets: Sequence[ScrapeTarget], rule_files: Sequence[Path] = ()) -> PrometheusServer:
        (port,) = local_triton.free_ports("127.0.0.1", 1)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {
                    "job_name": f"target-{index}",
                    "metrics_path": target.path,
                    "static_configs": [
                        {"targets": [target.address], "labels": dict(target.labels)}
                    ],
                }
                for index, target in enumerate(targets)
            ],
        }
        directory = tmp_path / f"prometheus-{len(started)}"
        directory.mkdir()
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        log_path = directory / "prometheus.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = PrometheusServer(f"http://127.0.0.1:{port}", process, log_path)
        started.append(server)
        deadline = time.monotonic() + 30
        while not _ready(server.url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        return server

    yield start
    for server in started:
        server.process.terminate()
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
