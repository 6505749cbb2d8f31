"""LocalTriton and its command line against the real tritonserver of the nvidia-pytriton wheel."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.http
from tritonclient.utils import InferenceServerException

from batchpilot_harness import demo_models, local_triton, procfs
from triton_fixtures import TritonFactory, triton_client

pytestmark = pytest.mark.integration

# What Triton answers to a load or unload request unless it runs with explicit model control.
NOT_EXPLICIT_ERROR = "explicit model load / unload is not allowed if polling is enabled"


def infer_gpu_sim(
    server: local_triton.LocalTriton, values: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    with triton_client(server) as client:
        tensor = tritonclient.http.InferInput("INPUT", list(values.shape), "FP32")
        tensor.set_data_from_numpy(values)
        output = client.infer(demo_models.GPU_SIM, [tensor]).as_numpy("OUTPUT")
    assert isinstance(output, np.ndarray)
    return output.astype(np.float32, copy=False)


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` that still exist, zombies included."""
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def test_explicit_server_loads_only_the_requested_models(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM)

    assert server.startup_seconds is not None
    assert server.startup_seconds < 30
    with triton_client(server) as client:
        states = {m["name"]: m.get("state") for m in client.get_model_repository_index()}
        assert client.is_server_ready()
    assert states[demo_models.GPU_SIM] == "READY"
    assert states[demo_models.TORCH_MLP] != "READY"
    values = np.linspace(-2, 2, 32, dtype=np.float32).reshape(2, 16)
    np.testing.assert_allclose(infer_gpu_sim(server, values), np.tanh(values), rtol=1e-6)


def test_stop_leaves_no_process_and_no_shared_memory_behind(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM)
    infer_gpu_sim(server, np.zeros((1, 16), dtype=np.float32))
    members = procfs.group_members(server.pid)
    assert len(members) == 1 + 4  # the server and one stub per gpu_sim instance
    assert list(Path("/dev/shm").glob(f"{server.shared_memory_prefix}*"))

    server.stop()

    assert alive(members) == []
    assert list(Path("/dev/shm").glob(f"{server.shared_memory_prefix}*")) == []


def test_server_that_ignores_sigterm_is_killed_with_its_stubs(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM)
    members = procfs.group_members(server.pid)
    os.kill(server.pid, signal.SIGSTOP)

    status = server.stop(grace_seconds=1.0)

    assert status == -signal.SIGKILL
    assert alive(members) == []


def test_model_that_fails_to_load_stops_the_start_with_its_error(
    triton_server: TritonFactory, tmp_path: Path
) -> None:
    broken = tmp_path / "repository" / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
    )
    (broken / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('broken on purpose')\n"
    )

    with pytest.raises(local_triton.LocalTritonError, match="broken on purpose"):
        triton_server("broken", model_repository=broken.parent)


def test_non_explicit_server_refuses_load_model(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM, explicit=False)

    with triton_client(server) as client:
        assert client.is_model_ready(demo_models.GPU_SIM)
        # Only the chosen model is in the repository the server sees.
        assert [m["name"] for m in client.get_model_repository_index()] == [demo_models.GPU_SIM]
        config = client.get_model_config(demo_models.GPU_SIM)
        with pytest.raises(InferenceServerException) as refusal:
            client.load_model(demo_models.GPU_SIM, config=json.dumps(config))

    assert refusal.value.message() == NOT_EXPLICIT_ERROR
    assert str(refusal.value.status()) == "503"


def test_two_servers_have_their_own_ports_and_device(triton_server: TritonFactory) -> None:
    first = triton_server(demo_models.GPU_SIM)
    second = triton_server(demo_models.GPU_SIM)

    assert {first.ports.http, first.ports.grpc, first.ports.metrics}.isdisjoint(
        {second.ports.http, second.ports.grpc, second.ports.metrics}
    )
    assert first.device_lock_path != second.device_lock_path
    for server in (first, second):
        infer_gpu_sim(server, np.ones((1, 16), dtype=np.float32))
        assert server.device_lock_path.exists()


def test_command_line_serves_until_sigterm_then_stops_everything(tmp_path: Path) -> None:
    http, grpc, metrics = local_triton.free_ports("127.0.0.1", 3)
    output = tmp_path / "output.log"
    arguments = [
        *("--host", "127.0.0.1"),
        *("--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)),
        *("--model-repository", str(demo_models.MODEL_REPOSITORY), "--model", "gpu_sim"),
    ]
    with output.open("wb") as sink:
        command = subprocess.Popen(
            [sys.executable, "-m", "batchpilot_harness.local_triton", *arguments],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        while not (ready := re.search(r"ready in .* pid=(\d+)", output.read_text())):
            assert command.poll() is None, output.read_text()
            time.sleep(0.1)
        server_pid = int(ready.group(1))
        members = procfs.group_members(server_pid)
        for url in (
            f"http://127.0.0.1:{http}/v2/health/ready",
            f"http://127.0.0.1:{metrics}/metrics",
        ):
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200

        command.send_signal(signal.SIGTERM)
        status = command.wait(timeout=30)
    finally:
        if command.poll() is None:
            command.kill()

    assert status == 0, output.read_text()
    assert server_pid in members
    assert alive(members) == []


def test_sigterm_to_a_program_that_runs_a_server_in_a_with_block_stops_the_server() -> None:
    """A benchmark or the demo killed with SIGTERM leaves no tritonserver or stub behind."""
    program = (
        "import sys, time\n"
        "from batchpilot_harness import demo_models, local_triton\n"
        "with local_triton.LocalTriton(model_repository=demo_models.MODEL_REPOSITORY,"
        " models=['gpu_sim']) as server:\n"
        "    print(server.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True
    ) as command:
        try:
            assert command.stdout is not None
            server_pid = int(command.stdout.readline())
            members = procfs.group_members(server_pid)
            command.send_signal(signal.SIGTERM)
            status = command.wait(timeout=30)
        finally:
            if command.poll() is None:
                command.kill()
    left = alive(members)
    for pid in left:  # what a failure would leave running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert status != 0, "interrupted, not finished"
    assert server_pid in members
    assert left == []


def test_a_relative_run_directory_serves_models_that_use_the_device_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server runs in its run directory, so a lock path relative to ours would not exist there.
    monkeypatch.chdir(tmp_path)
    server = local_triton.LocalTriton(
        model_repository=demo_models.MODEL_REPOSITORY,
        models=[demo_models.GPU_SIM],
        run_directory=Path("relative") / "run",
        environment={"BATCHPILOT_PROBE": "1"},
    )
    with server:
        assert server.run_directory == tmp_path / "relative" / "run"
        infer_gpu_sim(server, np.zeros((1, 16), dtype=np.float32))
        environment = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    assert b"BATCHPILOT_PROBE=1" in environment
    assert f"{local_triton.DEVICE_LOCK_ENV}={tmp_path}/relative/run/device.lock".encode() in (
        environment
    )
