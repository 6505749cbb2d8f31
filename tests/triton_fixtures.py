"""Fixtures that run real Triton servers (the nvidia-pytriton binary) for integration tests.

`triton_server` starts servers for one test, `module_triton_server` for all tests of a module (a
server with torch_mlp takes seconds to start). Both stop every server they started, stubs
included. When a test fails, the report gets the log path and tail of every server still running.
`run_command_until` runs `batchpilot run` as a process against them.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.request
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http

from batchpilot_harness import demo_models, local_triton

LOG_TAIL_BYTES = 3000

_running: list[local_triton.LocalTriton] = []


class TritonFactory:
    """Starts LocalTriton servers on free loopback ports and stops them all at teardown."""

    def __init__(self, run_root: Path) -> None:
        self._run_root = run_root
        self._servers: list[local_triton.LocalTriton] = []

    def __call__(
        self,
        *models: str,
        explicit: bool = True,
        model_repository: Path = demo_models.MODEL_REPOSITORY,
        ready_timeout: float = 60.0,
        repository_credential: tuple[str, str] | None = None,
    ) -> local_triton.LocalTriton:
        server = local_triton.LocalTriton(
            model_repository=model_repository,
            models=models,
            explicit_model_control=explicit,
            exit_timeout_seconds=1,
            run_directory=self._run_root / f"server-{len(self._servers)}",
            repository_credential=repository_credential,
        )
        self._servers.append(server)
        _running.append(server)
        server.start()
        server.wait_ready(ready_timeout)
        return server

    def stop_all(self) -> None:
        for server in self._servers:
            server.stop()
            _running.remove(server)
        self._servers.clear()


def _require_triton() -> None:
    try:
        local_triton.find_distribution()
    except local_triton.LocalTritonError as error:
        pytest.skip(str(error))


@pytest.fixture
def triton_server(tmp_path: Path) -> Iterator[TritonFactory]:
    _require_triton()
    factory = TritonFactory(tmp_path)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def module_triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonFactory]:
    _require_triton()
    factory = TritonFactory(tmp_path_factory.mktemp("triton"))
    yield factory
    factory.stop_all()


@contextmanager
def triton_client(
    server: local_triton.LocalTriton,
) -> Iterator[tritonclient.http.InferenceServerClient]:
    # Closed promptly: Triton spends its exit timeout waiting for open HTTP connections.
    client = tritonclient.http.InferenceServerClient(server.http_address)
    try:
        yield client
    finally:
        client.close()


@contextmanager
def dynamic_batching(
    client: tritonclient.http.InferenceServerClient, model: str, settings: Mapping[str, Any]
) -> Iterator[dict[str, Any]]:
    """Reload `model` with these dynamic_batching settings; restore its config afterwards."""
    original = client.get_model_config(model)
    client.load_model(model, config=json.dumps({**original, "dynamic_batching": dict(settings)}))
    try:
        yield client.get_model_config(model)
    finally:
        client.load_model(model, config=json.dumps(original))


@dataclasses.dataclass(frozen=True)
class RunnerProcess:
    """What a `batchpilot run` process wrote and served before it was stopped."""

    output: str
    """Its whole log (stderr)."""
    metrics: str
    """Its /metrics page, read once `until` was logged."""
    returncode: int


def run_command_until(
    policy_yaml: str, arguments: Sequence[str], tmp_path: Path, *, until: str
) -> RunnerProcess:
    """Run `batchpilot run --policy <policy_yaml> <arguments>` (0.5 s ticks, /metrics on a free
    port) until it logs a line containing `until`, read its metrics, then stop it with SIGTERM."""
    (listen_port,) = local_triton.free_ports("127.0.0.1", 1)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy_yaml, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "batchpilot",
        "run",
        "--policy",
        str(policy_file),
        *arguments,
        "--interval",
        "0.5",
        "--listen",
        f"127.0.0.1:{listen_port}",
    ]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        assert process.stderr is not None
        log: list[str] = []
        try:
            for line in process.stderr:
                log.append(line)
                if until in line:
                    break
            assert log, "the runner exited without a word"
            with urllib.request.urlopen(
                f"http://127.0.0.1:{listen_port}/metrics", timeout=5
            ) as page:
                metrics = page.read().decode()
        finally:
            # Also when the test times out waiting: Popen's exit would wait for ever on a
            # runner that was never told to stop.
            process.terminate()
        # Read the rest through the same buffered stream: `communicate()` reads the pipe
        # beneath it and would lose lines the loop above had read ahead.
        log.append(process.stderr.read())
        process.wait(timeout=20)
    return RunnerProcess(output="".join(log), metrics=metrics, returncode=process.returncode)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for server in _running:
            try:
                where, tail = str(server.log_path), server.log_tail(LOG_TAIL_BYTES)
            except local_triton.LocalTritonError:
                continue  # not started, or logging to the console
            report.sections.append((f"tritonserver log {where}", tail))
    return report
