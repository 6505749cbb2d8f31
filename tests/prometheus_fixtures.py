"""A real Prometheus server (`batchpilot_harness.local_prometheus`) for integration tests, and
its promtool.

`prometheus_server(targets)` starts one on a free loopback port with a 1 s scrape interval,
scraping the given `host:port` metrics endpoints with the given extra labels (a `job` label among
them replaces the default), evaluating the given rule files, and stops it at the end of the test;
`promtool` is the path of the package's rule checker. Tests that need either are skipped, saying
why, where the binary is missing (`make test` installs it).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import pytest

from batchpilot_harness.local_prometheus import PrometheusServer, ScrapeTarget, binary

__all__ = ["PrometheusServer", "ScrapeTarget", "StartPrometheus"]


class StartPrometheus(Protocol):
    def __call__(
        self, targets: Sequence[ScrapeTarget], rule_files: Sequence[Path] = ()
    ) -> PrometheusServer: ...


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool (Debian package `prometheus`; `make test` installs it)")
    return found


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[StartPrometheus]:
    if binary() is None:
        pytest.skip("no prometheus binary (Debian package `prometheus`; `make test` installs it)")
    started: list[PrometheusServer] = []

    def start(targets: Sequence[ScrapeTarget], rule_files: Sequence[Path] = ()) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus-{len(started)}", targets, rule_files)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()
