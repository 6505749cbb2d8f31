"""A real Grafana server (built by `make grafana`, see tools/batchpilot_cluster/grafana) for
integration tests.

`grafana_server(provisioning)` starts one on a free loopback port with its data, logs, plugins
and provisioning folders in the test's tmp dir, waits until its API answers, and stops it
(SIGTERM) at the end of the test. `provisioning` maps file names under Grafana's provisioning
folder (`datasources/x.yaml`, `dashboards/x.yaml`, `alerting/x.yaml`, ...) to their text.
Without a built Grafana the test fails, saying how to build one: a skip would let a dashboard
or an alert that no Grafana has loaded pass CI.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from batchpilot_cluster import building as go_building
from batchpilot_cluster.grafana import grafana_builds
from batchpilot_harness import local_triton

ADMIN = "admin"
PROVISIONING_FOLDERS = tuple(
    f"provisioning/{kind}"
    for kind in ("datasources", "dashboards", "alerting", "plugins", "notifiers", "access-control")
)
"""Every folder Grafana reads provisioning from: a missing one is logged as an error."""
LOG_TAIL_CHARACTERS = 3000
STARTUP_ORG_RACE = "failed to create default organization: UNIQUE constraint failed: org.id"
"""How Grafana 10.0's first start on an empty SQLite database sometimes fails: creating the
admin user makes the main org, and the check for it that follows, in a transaction that began
before, does not see it and inserts it again (grafana/grafana#71781; #68644 meant to ignore the
conflict, but SQLite's error is not recognised as one). The database then has the org, so a
later start on it gets past this; the fixture starts it again, and only for this."""
STARTS = 3
"""Grafana's starts in all, the first included: the race loses at most one start on a database,
and a test of the retry makes a start fail this way before that real first start (busy run a2
lost both)."""


class GrafanaError(RuntimeError):
    pass


@dataclass(frozen=True)
class GrafanaServer:
    url: str
    password: str
    process: subprocess.Popen[bytes]
    log_path: Path
    version: str

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """A JSON API call as the admin; raises GrafanaError with Grafana's answer on 4xx/5xx."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        token = base64.b64encode(f"{ADMIN}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raise GrafanaError(f"{method} {path}: {error.code} {error.read().decode()}") from error

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def errors(self, logger: str) -> list[str]:
        """The log's error lines from loggers whose name starts with `logger`."""
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if line.startswith(f"logger={logger}") and " level=error " in line
        ]


class StartGrafana(Protocol):
    def __call__(self, provisioning: Mapping[str, str]) -> GrafanaServer: ...


def configuration(*, directory: Path, port: int, password: str) -> str:
    """grafana.ini: loopback only, everything written under `directory`, nothing phoned home,
    alert rules evaluated as often as Grafana allows (its scheduler ticks every 10 s)."""
    return f"""\
[paths]
data = {directory / "data"}
logs = {directory / "logs"}
plugins = {directory / "plugins"}
provisioning = {directory / "provisioning"}

[server]
http_addr = 127.0.0.1
http_port = {port}

[database]
type = sqlite3

[security]
admin_user = {ADMIN}
admin_password = {password}

[analytics]
reporting_enabled = false
check_for_updates = false
check_for_plugin_updates = false

[news]
news_feed_enabled = false

[snapshots]
external_enabled = false

[log]
mode = file
level = info

[alerting]
enabled = false

[unified_alerting]
enabled = true
min_interval = 10s
"""


def _wait_healthy(
    url: str, process: subprocess.Popen[bytes], *, seconds: float = 90
) -> dict[str, Any] | None:
    """Grafana's health once its database is ok; None if it exited or did not get there."""
    deadline = time.monotonic() + seconds
    while (health := _health(url)) is None or health.get("database") != "ok":
        if process.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.5)
    return health


def _health(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{url}/api/health", timeout=1) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except (OSError, ValueError):
        return None


@pytest.fixture
def grafana_server(tmp_path: Path) -> Iterator[StartGrafana]:
    try:
        grafana = grafana_builds.require()
    except go_building.BuildError as error:
        pytest.fail(f"{error}. Grafana is what loads the chart's dashboard and alerts here.")
    stopping: list[subprocess.Popen[bytes]] = []

    def start(provisioning: Mapping[str, str]) -> GrafanaServer:
        directory = tmp_path / f"grafana-{len(stopping)}"
        for folder in ("data", "logs", "plugins", *PROVISIONING_FOLDERS):
            (directory / folder).mkdir(parents=True)
        for name, text in provisioning.items():
            path = directory / "provisioning" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (port,) = local_triton.free_ports("127.0.0.1", 1)
        password = secrets.token_urlsafe(16)
        config = directory / "grafana.ini"
        config.write_text(configuration(directory=directory, port=port, password=password))
        log_path = directory / "logs" / "grafana.log"
        url = f"http://127.0.0.1:{port}"
        for attempt in range(STARTS):
            with (directory / "stdout.log").open("wb") as output:
                process = subprocess.Popen(
                    [
                        str(grafana.binary),
                        "server",
                        f"--homepath={grafana.home}",
                        f"--config={config}",
                    ],
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    cwd=directory,
                )
            stopping.append(process)
            health = _wait_healthy(url, process)
            if health is not None:
                break
            said = (directory / "stdout.log").read_text(errors="replace")
            if attempt < STARTS - 1 and process.poll() is not None and STARTUP_ORG_RACE in said:
                continue  # it lost the race on the empty database: once more
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            raise GrafanaError(
                f"grafana did not start: {said[-LOG_TAIL_CHARACTERS:]}{log[-LOG_TAIL_CHARACTERS:]}"
            )
        return GrafanaServer(url, password, process, log_path, str(health.get("version", "")))

    yield start
    for process in stopping:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
