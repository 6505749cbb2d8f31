"""The operator reads an LLM model's model.json from the sidecar beside its Pod: the sidecar's own
app answers, what it cannot give refuses the profile with its reason, and the operator's fleet
lays a profile over what the sidecar served."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from batchpilot import operating
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import engines, pod_repositories
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_sidecar import serving
from fake_triton import FakeTriton
from sidecar_builders import Clock, make_collector
from web_apps import ServeApp

MODEL = "tiny_llm"
REPOSITORY_ARGUMENTS = {"model": "/models/tiny-llama", "max_model_len": 512, "max_num_seqs": 16}
# What tritonserver 2.51 reported for manifests/llm-repository/tiny_llm (GET .../config), cut.
SERVED: dict[str, Any] = {
    "name": MODEL,
    "backend": "vllm",
    "max_batch_size": 0,
    "parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "true"}},
}


def sidecar_app(tmp_path: Path, *, with_repository: bool = True) -> web.Application:
    """The real sidecar's app, over a repository whose newest version of tiny_llm is 3."""
    repository = tmp_path / "models"
    for version in ("1", "3"):
        (repository / MODEL / version).mkdir(parents=True)
        (repository / MODEL / version / "model.json").write_text(json.dumps(REPOSITORY_ARGUMENTS))
    return serving.application(
        make_collector(
            FakeTriton(), Clock(), model_repository=repository if with_repository else None
        )
    )


def pod(sidecar_url: str | None, http_url: str = "http://127.0.0.1:9") -> Replica:
    return Replica(name="triton-0", http_url=http_url, sidecar_url=sidecar_url, kind="pod")


async def test_the_pods_sidecar_gives_the_model_json_of_the_newest_version(
    tmp_path: Path, serve_app: ServeApp
) -> None:
    sidecar = await serve_app(sidecar_app(tmp_path))
    found = await pod_repositories.SidecarEngineArguments().repository_arguments(
        pod(sidecar), MODEL
    )
    assert found == engines.RepositoryArguments("3", REPOSITORY_ARGUMENTS)


@pytest.mark.parametrize(
    ("model", "with_repository", "reason"),
    [
        ("absent", True, r"\(HTTP 404\): model 'absent' is not in the model repository"),
        (MODEL, False, r"\(HTTP 404\): this sidecar reads no model repository"),
        ("..", True, r"^'\.\.' is not a model name"),
    ],
)
async def test_what_the_sidecar_cannot_give_refuses_the_profile_with_its_reason(
    tmp_path: Path, serve_app: ServeApp, model: str, with_repository: bool, reason: str
) -> None:
    sidecar = await serve_app(sidecar_app(tmp_path, with_repository=with_repository))
    with pytest.raises(engines.EngineArgumentsUnavailable, match=reason):
        await pod_repositories.SidecarEngineArguments().repository_arguments(pod(sidecar), model)


async def test_an_answer_that_is_no_engine_arguments_refuses_the_profile(
    serve_app: ServeApp,
) -> None:
    async def wrong(_: web.Request) -> web.Response:
        return web.json_response({"version": "latest", "arguments": {}})

    app = web.Application()
    app.router.add_get("/v1/models/{model}/engine-arguments", wrong)
    sidecar = await serve_app(app)
    with pytest.raises(engines.EngineArgumentsUnavailable, match="not a version directory's name"):
        await pod_repositories.SidecarEngineArguments().repository_arguments(pod(sidecar), MODEL)


async def test_credentials_in_the_model_json_are_never_served_and_refuse_the_profile(
    tmp_path: Path, serve_app: ServeApp
) -> None:
    repository = tmp_path / "models"
    (repository / MODEL / "1").mkdir(parents=True)
    token = "hf_Abc123SecretValue"
    carried = {
        **REPOSITORY_ARGUMENTS,
        "hf_token": token,
        "hf_overrides": {"api_key": token, "rope_theta": 10000},
        "trust_remote_code": False,
    }
    (repository / MODEL / "1" / "model.json").write_text(json.dumps(carried))
    app = serving.application(make_collector(FakeTriton(), Clock(), model_repository=repository))
    sidecar = await serve_app(app)
    async with (
        aiohttp.ClientSession() as session,
        session.get(pod_repositories.engine_arguments_url(sidecar, MODEL)) as response,
    ):
        page = await response.text()
    assert token not in page
    assert json.loads(page)["withheld"] == ["hf_token", "hf_overrides.api_key"]
    assert json.loads(page)["arguments"]["hf_overrides"] == {"rope_theta": 10000}
    with pytest.raises(engines.EngineArgumentsUnavailable, match=r"carries credentials \(hf_to"):
        await pod_repositories.SidecarEngineArguments().repository_arguments(pod(sidecar), MODEL)


async def test_a_sidecar_that_does_not_answer_refuses_the_profile() -> None:
    # Nothing listens on the discard port of loopback: the connection is refused at once.
    source = pod_repositories.SidecarEngineArguments(timeout=2.0)
    with pytest.raises(engines.EngineArgumentsUnavailable, match=r"sidecar http://127.0.0.1:9 of"):
        await source.repository_arguments(pod("http://127.0.0.1:9"), MODEL)


async def test_a_pod_without_a_sidecar_refuses_the_profile_and_says_so() -> None:
    with pytest.raises(engines.EngineArgumentsUnavailable, match="beside pod triton-0, which has"):
        await pod_repositories.SidecarEngineArguments().repository_arguments(pod(None), MODEL)


class ScriptedLlmTriton:
    """A Triton serving one vLLM model: a load takes the config it is sent, files and all."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = dict(SERVED)
        self.loads: list[dict[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v2/models/{model}/config", self.get_config)
        app.router.add_get("/v2/models/{model}/ready", self.ready)
        app.router.add_post("/v2/repository/models/{model}/load", self.load)
        return app

    async def get_config(self, _: web.Request) -> web.Response:
        return web.json_response(self.config)

    async def ready(self, _: web.Request) -> web.Response:
        return web.Response()

    async def load(self, request: web.Request) -> web.Response:
        parameters: dict[str, str] = (await request.json())["parameters"]
        self.loads.append(parameters)
        self.config = json.loads(parameters["config"])
        return web.json_response({})


async def test_the_operators_fleet_lays_the_profile_over_the_model_json_of_the_pods_sidecar(
    tmp_path: Path, serve_app: ServeApp
) -> None:
    triton = ScriptedLlmTriton()
    replica = pod(await serve_app(sidecar_app(tmp_path)), http_url=await serve_app(triton.app()))
    settings = rendering.render(specs.Profile.model_validate({"llm": {"maxNumSeqs": 4}}))
    fleet = operating.triton_fleet()
    try:
        applied = await fleet.apply(
            replica, MODEL, settings, profile="interactive", unload_first=False, verify_timeout=5
        )
    finally:
        await fleet.close()
    assert applied.reloaded
    (load,) = triton.loads
    assert set(load) == {"config", "file:3/model.json"}
    assert json.loads(base64.b64decode(load["file:3/model.json"])) == {
        **REPOSITORY_ARGUMENTS,
        "max_num_seqs": 4,
    }
