"""A real Prometheus server (Debian's `prometheus` package) on a loopback port.

For the integration tests (`tests/prometheus_fixtures.py`) and the e2e tests, which stop it and
start it again to see what `spec.load.source: prometheus` does without it. It scrapes the given
`host:port` endpoints every second with the given extra labels (a `job` label among them replaces
the default) and evaluates the given rule files. A second start keeps the port and the data, as a
restarted Prometheus in a cluster keeps its Service and its volume.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchpilot_harness import local_triton

START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class ScrapeTarget:
    address: str
    """host:port"""
    labels: Mapping[str, str]
    path: str = "/metrics"


def binary() -> str | None:
    return shutil.which("prometheus")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:  # noqa: S310
            return bool(response.status == 200)
    except OSError:
        return False


def _config(targets: Sequence[ScrapeTarget], rule_files: Sequence[Path]) -> dict[str, object]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": f"target-{index}",
                "metrics_path": target.path,
                "static_configs": [{"targets": [target.address], "labels": dict(target.labels)}],
            }
            for index, target in enumerate(targets)
        ],
    }


class PrometheusServer:
    """One server, in `directory` (its config, data and log), on a free loopback port."""

    def __init__(
        self,
        directory: Path,
        targets: Sequence[ScrapeTarget],
        rule_files: Sequence[Path] = (),
    ) -> None:
        found = binary()
        if found is None:
            raise FileNotFoundError("no prometheus binary (Debian package `prometheus`)")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "prometheus.yml").write_text(yaml.safe_dump(_config(targets, rule_files)))
        (port,) = local_triton.free_ports("127.0.0.1", 1)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = directory / "prometheus.log"
        self._command = [
            found,
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (again, on the same port and data) and wait until it is ready."""
        if self.process is not None and self.process.poll() is None:
            return
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(  # noqa: S603 -- our own argument vector
                self._command, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not _ready(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"prometheus did not start: {tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_SECONDS."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
