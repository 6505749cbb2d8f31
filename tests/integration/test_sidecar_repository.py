"""A vLLM model's model.json, from the sidecar process to the operator: the real sidecar, beside a
real Triton (serving gpu_sim: the sidecar only needs a Triton to point at, and no engine starts),
mounts the LLM test world's repository and serves the file, which the operator's source reads."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batchpilot.applying import engines, pod_repositories
from batchpilot.applying.replicas import Replica
from batchpilot_harness import demo_models, llm_models, local_sidecar
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.timeout(120)
async def test_the_operator_reads_the_model_json_the_sidecar_serves_from_its_repository(
    triton_server: TritonFactory, tmp_path: Path
) -> None:
    repository = llm_models.write_repository(tmp_path)
    server = triton_server(demo_models.GPU_SIM)
    with local_sidecar.running(
        server, "--model-repository", str(repository), log=tmp_path / "sidecar.log"
    ) as sidecar:
        status, served = get(f"{sidecar.url}/v1/models/{llm_models.LLM_MODEL}/engine-arguments")
        assert status == 200
        assert served == {
            "model": llm_models.LLM_MODEL,
            "version": "1",
            "arguments": llm_models.base_engine_arguments(),
        }
        replica = Replica(
            name="triton-0", http_url=server.http_url, sidecar_url=sidecar.url, kind="pod"
        )
        source = pod_repositories.SidecarEngineArguments()
        found = await source.repository_arguments(replica, llm_models.LLM_MODEL)
        assert found == engines.RepositoryArguments("1", llm_models.base_engine_arguments())
        # The model Triton serves is not in this repository: the sidecar says so, and the
        # operator refuses the profile with its reason.
        with pytest.raises(engines.EngineArgumentsUnavailable, match=r"HTTP 404.*not in the model"):
            await source.repository_arguments(replica, demo_models.GPU_SIM)
        status, refused = get(f"{sidecar.url}/v1/models/..%2F..%2Fetc/engine-arguments")
        assert status == 400
        assert "is not a model name" in refused["error"]
