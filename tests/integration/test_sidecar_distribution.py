"""The sidecar's own distribution (sidecar/pyproject.toml, what its image installs) runs alone:
installed into an empty virtualenv it carries neither kopf, the Kubernetes client nor the rest of
batchpilot, and serves a /status that the operator's reader accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from batchpilot.signals import sidecars
from batchpilot_harness import demo_models, local_triton
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NOT_CARRIED = ("kopf", "kubernetes", "prometheus-api-client", "pydantic", "exchange-calendars")


@pytest.fixture(scope="module")
def sidecar_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("sidecar-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    environment = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    environment.pop("PYTHONPATH", None)
    # As its image installs it: the lock's export with hashes, then the distribution alone.
    pip = [str(venv / "bin" / "pip"), "install", "--quiet"]
    for step in (
        ["--require-hashes", "-r", str(REPO / "requirements" / "build.txt")],
        ["--require-hashes", "-r", str(REPO / "requirements" / "sidecar-image.txt")],
        ["--no-deps", "--no-build-isolation", str(REPO / "sidecar")],
    ):
        installed = subprocess.run(
            [*pip, *step],
            capture_output=True,
            text=True,
            timeout=480,
            env=environment,
            check=False,
        )
        assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


@pytest.mark.timeout(600)
def test_the_sidecar_distribution_carries_no_operator_stack(sidecar_venv: Path) -> None:
    listed = subprocess.run(
        [str(sidecar_venv / "bin" / "pip"), "list", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    names = {package["name"].lower() for package in json.loads(listed.stdout)}
    assert "batchpilot-sidecar" in names
    assert names.isdisjoint(NOT_CARRIED), names & set(NOT_CARRIED)
    product = subprocess.run(
        [str(sidecar_venv / "bin" / "python"), "-c", "import batchpilot"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=sidecar_venv,
        check=False,
    )
    assert "No module named 'batchpilot'" in product.stderr


@pytest.mark.timeout(600)
def test_the_installed_sidecar_serves_a_status_the_operator_reads(
    sidecar_venv: Path, triton_server: TritonFactory, tmp_path: Path
) -> None:
    triton = triton_server(demo_models.GPU_SIM)
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    log = tmp_path / "sidecar.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [
                str(sidecar_venv / "bin" / "python"),
                "-m",
                "batchpilot_sidecar",
                "--triton-url",
                triton.http_url,
                "--metrics-url",
                triton.metrics_url,
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=sidecar_venv,
        )
    try:
        document = None
        deadline = time.monotonic() + 60
        while document is None or demo_models.GPU_SIM not in document.models:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/status?sloP95Ms=50", timeout=5
                ) as answer:
                    document = sidecars.STATUS_DOCUMENT.validate_json(answer.read())
            except (urllib.error.URLError, ConnectionError):
                continue
        assert document.sidecar.triton_url == triton.http_url
        assert document.objective is not None
        assert document.objective.slo_p95_ms == 50
    finally:
        process.terminate()
        process.wait(timeout=30)
