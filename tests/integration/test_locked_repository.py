"""A real tritonserver whose model-repository API is locked to a header, as the manifests run
it: anything without the header can infer but cannot load code; the operator's client, the
rollout and the runner switch with it; a wrong one changes nothing and says so."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc
import tritonclient.http
from tritonclient.utils import InferenceServerException

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, credentials, fleets, rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_harness import demo_models, local_triton
from batchpilot_triton import modelconfigs, servers
from triton_fixtures import TritonFactory, run_command_until, triton_client

pytestmark = pytest.mark.integration

HEADER = specs.DEFAULT_REPOSITORY_HEADER
TOKEN = "3f9d1c0b7a5e2d48"
CREDENTIAL = (HEADER, TOKEN)
BULK = rendering.render(
    specs.Profile.model_validate(
        {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]}
    )
)


def infers(server: local_triton.LocalTriton) -> bool:
    values = np.ones((1, 16), dtype=np.float32)
    with triton_client(server) as client:
        tensor = tritonclient.http.InferInput("INPUT", list(values.shape), "FP32")
        tensor.set_data_from_numpy(values)
        return client.infer(demo_models.GPU_SIM, [tensor]).as_numpy("OUTPUT") is not None


def post_load_with_model_py(server: local_triton.LocalTriton) -> int:
    """What an attacker in the cluster would send: a load carrying its own `model.py` (an
    inert one here: it only fails to be a model)."""
    code = b"raise RuntimeError('this model.py must never be loaded')\n"
    body = {"parameters": {"file:1/model.py": base64.b64encode(code).decode()}}
    return status_of(
        urllib.request.Request(
            f"{server.http_url}/v2/repository/models/{demo_models.GPU_SIM}/load",
            data=json.dumps(body).encode(),
            method="POST",
        )
    )


def status_of(request: urllib.request.Request) -> int:
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


async def served_config(server: local_triton.LocalTriton) -> modelconfigs.ModelConfig:
    async with servers.TritonServer(server.http_url) as triton:
        return await triton.model_config(demo_models.GPU_SIM)


@pytest.mark.timeout(90)
async def test_without_the_header_loads_are_refused_while_inference_works(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM, repository_credential=CREDENTIAL)
    before = await served_config(server)
    assert post_load_with_model_py(server) == 403
    with triton_client(server) as client:
        for refused in (
            lambda: client.load_model(demo_models.GPU_SIM),
            lambda: client.unload_model(demo_models.GPU_SIM),
            client.get_model_repository_index,
        ):
            with pytest.raises(InferenceServerException, match="restricted"):
                refused()
    # Over gRPC too.
    grpc = tritonclient.grpc.InferenceServerClient(server.grpc_address)
    try:
        with pytest.raises(InferenceServerException):
            grpc.load_model(demo_models.GPU_SIM)
    finally:
        grpc.close()
    assert infers(server)
    assert await served_config(server) == before
    async with servers.TritonServer(server.http_url) as triton:
        with pytest.raises(servers.RepositoryLocked, match="refused the credential"):
            await triton.load(demo_models.GPU_SIM)


@pytest.mark.timeout(90)
async def test_the_operators_client_switches_a_locked_server_with_the_header(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM, repository_credential=CREDENTIAL)
    async with servers.TritonServer(server.http_url, repository_headers={HEADER: TOKEN}) as triton:
        assert await triton.loaded_models() == [demo_models.GPU_SIM]
        applied = await actuators.apply_profile(
            triton, demo_models.GPU_SIM, BULK, profile="bulk", unload_first=True, verify_timeout=30
        )
        assert applied.reloaded
        assert modelconfigs.applied_profile(await triton.model_config(demo_models.GPU_SIM)) == (
            "bulk"
        )
    assert infers(server)


@pytest.mark.timeout(90)
async def test_a_wrong_header_leaves_the_model_serving_its_old_config_and_says_why(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM, repository_credential=CREDENTIAL)
    before = await served_config(server)
    async with servers.TritonServer(
        server.http_url, repository_headers={HEADER: "not-the-token"}
    ) as triton:
        with pytest.raises(servers.RepositoryLocked) as refused:
            await actuators.apply_profile(
                triton, demo_models.GPU_SIM, BULK, profile="bulk", verify_timeout=10
            )
    assert "batchpilot-repository-token" in refused.value.message
    assert "not-the-token" not in refused.value.message
    assert await served_config(server) == before
    assert infers(server)


@pytest.mark.timeout(120)
async def test_a_rollout_switches_with_the_fleets_credential_and_a_wrong_one_touches_nothing(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(demo_models.GPU_SIM, repository_credential=CREDENTIAL)
    replica = Replica(name="triton-0", http_url=server.http_url, gated=False, gate=None)
    plan = rollouts.Plan(
        namespace="", profile="bulk", settings=BULK, rollout=specs.Rollout(), settle_seconds=0
    )
    # Generous: a loaded machine must not turn a slow answer into a failed rollout.
    fleet = fleets.TritonFleet(request_timeout=30, load_timeout=120)
    try:
        wrong = await credentials.GivenCredential("wrong", source="test").repository_headers(
            "", None
        )
        await fleet.hold("policy", [server.http_url], repository_headers=wrong)
        survey = await rollouts.survey([replica], [demo_models.GPU_SIM], fleet)
        result = await rollouts.roll_out([replica], survey, plan, fleet, rollouts.NoGates())
        [outcome] = result.outcomes
        assert (outcome.state, outcome.error) == ("Failed", "credential_refused")
        assert modelconfigs.applied_profile(await served_config(server)) is None

        await fleet.hold("policy", [server.http_url], repository_headers={HEADER: TOKEN})
        survey = await rollouts.survey([replica], [demo_models.GPU_SIM], fleet)
        result = await rollouts.roll_out([replica], survey, plan, fleet, rollouts.NoGates())
        assert [o.state for o in result.outcomes] == ["Updated"]
        assert modelconfigs.applied_profile(await served_config(server)) == "bulk"
    finally:
        await fleet.close()


@pytest.mark.timeout(60)
def test_the_runner_reads_the_credential_from_a_file_never_its_command_line(
    triton_server: TritonFactory, tmp_path: Path
) -> None:
    server = triton_server(demo_models.GPU_SIM, repository_credential=CREDENTIAL)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    runner = run_command_until(
        "apiVersion: batchpilot.dev/v1alpha1\nkind: BatchPolicy\nmetadata: {name: cli}\n"
        "spec:\n  target: {selector: {matchLabels: {app: triton}}, models: [gpu_sim]}\n"
        "  profiles: {bulk: {maxQueueDelayMicroseconds: 20000, preferredBatchSizes: [32]}}\n"
        "  defaultProfile: bulk\n",
        [
            "--triton",
            server.http_url,
            "--triton-metrics",
            server.metrics_url,
            "--repository-token-file",
            str(token_file),
        ],
        tmp_path,
        until="applied bulk to gpu_sim",
    )
    assert runner.returncode == 0, runner.output
    assert TOKEN not in runner.output


@pytest.mark.timeout(60)
def test_the_command_line_locks_the_repository_with_the_value_from_its_environment(
    tmp_path: Path,
) -> None:
    """`python -m batchpilot_harness.local_triton --repository-header`: the header on the
    command line, the value in the environment (as a Pod's Secret would put it)."""
    http, grpc, metrics = local_triton.free_ports("127.0.0.1", 3)
    output = tmp_path / "output.log"
    arguments = [
        *("--host", "127.0.0.1", "--repository-header", HEADER),
        *("--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)),
        *("--model-repository", str(demo_models.MODEL_REPOSITORY), "--model", "gpu_sim"),
    ]
    environment = {**os.environ, local_triton.REPOSITORY_TOKEN_ENV: TOKEN}
    with output.open("wb") as sink:
        command = subprocess.Popen(
            [sys.executable, "-m", "batchpilot_harness.local_triton", *arguments],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=environment,
        )
    try:
        while "ready in" not in output.read_text():
            assert command.poll() is None, output.read_text()
            time.sleep(0.1)
        index = f"http://127.0.0.1:{http}/v2/repository/index"
        answers = [
            status_of(urllib.request.Request(index, data=b"{}", headers=headers, method="POST"))
            for headers in ({}, {HEADER: "wrong"}, {HEADER: TOKEN})
        ]
        assert answers == [403, 403, 200]
        command.send_signal(signal.SIGTERM)
        assert command.wait(timeout=30) == 0
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(timeout=30)
