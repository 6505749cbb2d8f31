"""The demo models and the GPU check under NumPy 2, as on the lent GPU machines.

The project's virtualenv has NumPy 1 (nvidia-pytriton pins it); the first GPU check ran where
NumPy is 2.x, and every one of its 96,743 requests failed (HTTP 500: the Python-backend stub
mis-sized output arrays NumPy 2 made) while the check printed OK. These tests run a real Triton
whose Python stubs import NumPy 2 (`batchpilot_harness.numpy2_env`), and the GPU check on the
CPU in that environment: it passes when every request is served, and fails, with the reason on
its last line, with the model as it was.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from test_demo_models import infer

from batchpilot_harness import demo_models, loadgen, local_triton, numpy2_env, procfs
from triton_fixtures import TritonFactory, triton_client

pytestmark = pytest.mark.integration

# What torch_mlp returned before it handed tensors over by DLPack.
DLPACK_OUTPUT = (
    'pb_utils.Tensor.from_dlpack("OUTPUT", torch.utils.dlpack.to_dlpack(values.contiguous()))'
)
NUMPY_OUTPUT = 'pb_utils.Tensor("OUTPUT", values.numpy())'


@pytest.fixture(scope="module")
def numpy2_python() -> Path:
    environment = numpy2_env.build(say=lambda _: None)
    found = subprocess.run(
        [str(numpy2_env.python(environment)), "-c", "import numpy; print(numpy.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert found.startswith("2."), found
    return numpy2_env.python(environment)


@pytest.fixture(scope="module")
def numpy2_triton(
    numpy2_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[local_triton.LocalTriton]:
    server = local_triton.LocalTriton(
        model_repository=demo_models.MODEL_REPOSITORY,
        models=[demo_models.GPU_SIM, demo_models.TORCH_MLP],
        exit_timeout_seconds=1,
        run_directory=tmp_path_factory.mktemp("numpy2-triton"),
        interpreter=numpy2_python,
    )
    with server:
        yield server


@pytest.fixture(scope="module")
def numpy1_triton(module_triton_server: TritonFactory) -> local_triton.LocalTriton:
    return module_triton_server(demo_models.TORCH_MLP)


@pytest.mark.timeout(180)
def test_both_models_answer_under_numpy_2_as_under_numpy_1(
    numpy2_triton: local_triton.LocalTriton, numpy1_triton: local_triton.LocalTriton
) -> None:
    values = np.random.default_rng(3).normal(size=(4, 256)).astype(np.float32)
    with triton_client(numpy2_triton) as client:
        mlp = infer(client, demo_models.TORCH_MLP, values)
        sim = infer(client, demo_models.GPU_SIM, values[:, :16])
    with triton_client(numpy1_triton) as client:
        reference = infer(client, demo_models.TORCH_MLP, values)
    np.testing.assert_array_equal(mlp, reference)
    np.testing.assert_allclose(sim, np.tanh(values[:, :16]), rtol=1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", [demo_models.GPU_SIM, demo_models.TORCH_MLP])
def test_every_request_under_load_is_served_under_numpy_2(
    numpy2_triton: local_triton.LocalTriton, model: str
) -> None:
    async def load() -> loadgen.LoadResult:
        async with aiohttp.ClientSession() as session:
            payload = await loadgen.payload_from_metadata(session, numpy2_triton.http_url, model)
        return await loadgen.run_load(
            base_url=numpy2_triton.http_url,
            payload=payload,
            phases=[loadgen.Phase(rate=60, seconds=3)],
            seed=5,
        )

    result = asyncio.run(load())
    failed = [r.error for r in result.records if not r.succeeded]
    assert len(result.records) > 100
    assert failed == []


def check_command(numpy2_python: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(numpy2_python),
        "-m",
        "batchpilot_harness.gpuchecks",
        "run",
        "--device=cpu",
        "--rate=50",
        f"--out={out}",
        *extra,
    ]


def check(numpy2_python: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        check_command(numpy2_python, out, *extra),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.timeout(300)
def test_the_gpu_check_on_the_cpu_under_numpy_2_serves_every_request_and_passes(
    numpy2_python: Path, tmp_path: Path
) -> None:
    done = check(numpy2_python, tmp_path, "--segment-seconds=4", "--cycles=2")
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("gpu-check: Python 3.11"), lines[0]
    assert f"NumPy {numpy2_env.NUMPY_VERSION}" in lines[0]
    assert lines[-1] == "gpu-check: OK", done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0
    assert ", 0 failed; p50" in (tmp_path / "gpu-check.txt").read_text()


@pytest.mark.timeout(300)
def test_the_gpu_check_fails_with_the_model_that_failed_every_request_on_the_gpu(
    numpy2_python: Path, tmp_path: Path
) -> None:
    repository = tmp_path / "repository"
    shutil.copytree(demo_models.MODEL_REPOSITORY / demo_models.TORCH_MLP, repository / "torch_mlp")
    model = repository / "torch_mlp" / "1" / "model.py"
    source = model.read_text()
    assert DLPACK_OUTPUT in source, "torch_mlp no longer hands its output over as this test knows"
    model.write_text(source.replace(DLPACK_OUTPUT, NUMPY_OUTPUT))

    done = check(
        numpy2_python,
        tmp_path / "out",
        "--segment-seconds=3",
        "--cycles=1",
        f"--model-repository={repository}",
    )
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert last.startswith("gpu-check: FAILED: "), done.stdout[-3000:] + done.stderr[-2000:]
    assert "requests sent outside the switches failed" in last
    assert "output tensor shape does not match size of output" in last


@pytest.mark.timeout(300)
def test_a_tritonserver_that_dies_mid_run_is_the_last_line_with_its_exit_status(
    numpy2_python: Path, tmp_path: Path
) -> None:
    # A CI run once lost its tritonserver during the first reload: the check printed a
    # traceback instead of its verdict, and nothing said what became of the server.
    command = check_command(numpy2_python, tmp_path, "--segment-seconds=30", "--cycles=1")
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as run:
        assert run.stdout is not None
        for line in run.stdout:
            if line.startswith("Applied "):
                break
        else:
            pytest.fail(f"the check ended before its first switch: {run.stderr.read()}")
        (server,) = [
            pid
            for pid in procfs.children(run.pid)
            if Path(os.readlink(f"/proc/{pid}/exe")).name == "tritonserver"
        ]
        os.kill(server, signal.SIGKILL)
        rest, errors = run.communicate(timeout=120)
    last = (rest.strip().splitlines() or ["(no line after the first switch)"])[-1]
    assert run.returncode == 1, rest[-3000:] + errors[-2000:]
    assert last.startswith("gpu-check: FAILED: the run failed: the measurement broke off: "), (
        rest[-3000:] + errors[-2000:]
    )
    assert f"tritonserver exited with status -{int(signal.SIGKILL)}" in last
    assert "Traceback" not in errors, errors[-2000:]


def test_the_projects_own_numpy_is_1_so_numpy_2_needs_the_environment_above() -> None:
    # When nvidia-pytriton lifts its numpy<2 pin, the project's own Triton tests cover NumPy 2
    # and numpy2_env can go.
    assert np.__version__.startswith("1."), "the project's NumPy is 2 now: revisit numpy2_env"
