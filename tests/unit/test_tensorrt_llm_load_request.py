"""The exact load requests the actuator sends for a TensorRT-LLM model, against a scripted
Triton HTTP API on loopback.

TensorRT-LLM needs an NVIDIA GPU and an engine built for it, so it cannot run here; the boundary
is faked at the HTTP level instead: the scripted server speaks the part of Triton's API the
actuator uses (model config, model readiness, repository load) and keeps every load request's
body, so the tests can assert the JSON Triton would receive, byte for byte once parsed."""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, overrides
from batchpilot.policy import rendering
from batchpilot_triton import servers
from web_apps import ServeApp

MODEL = "tensorrt_llm"
REPOSITORY_CONFIG: dict[str, Any] = {
    "name": MODEL,
    "platform": "",
    "backend": "tensorrtllm",
    "max_batch_size": 64,
    "model_transaction_policy": {"decoupled": True},
    "dynamic_batching": {"preferred_batch_size": [64], "max_queue_delay_microseconds": 100},
    "instance_group": [{"name": "tensorrt_llm_0", "kind": "KIND_CPU", "count": 1}],
    "parameters": {
        "gpt_model_type": {"string_value": "inflight_fused_batching"},
        "gpt_model_path": {"string_value": "/engines/llama/1-gpu"},
        "batch_scheduler_policy": {"string_value": "guaranteed_no_evict"},
        "enable_chunked_context": {"string_value": "false"},
    },
}


class ScriptedTriton:
    """Serves one model's config; a load replaces it with the request's config override, unless
    the load is to be rejected the way Triton rejects a backend that fails to start."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = copy.deepcopy(config)
        self.load_requests: list[dict[str, Any]] = []
        self.reject_loads = 0
        """How many of the next loads fail (the model keeps serving its old config)."""

    async def model_config(self, request: web.Request) -> web.Response:
        return web.json_response(self.config)

    async def model_ready(self, request: web.Request) -> web.Response:
        return web.Response()

    async def live(self, request: web.Request) -> web.Response:
        return web.Response()

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.load_requests.append(body)
        if self.reject_loads:
            self.reject_loads -= 1
            return web.json_response(
                {"error": f"load failed for model '{MODEL}': version 1 is at UNAVAILABLE state"},
                status=400,
            )
        self.config = json.loads(body["parameters"]["config"])
        return web.json_response({})


Serve = Callable[[ScriptedTriton], Awaitable[str]]


@pytest.fixture
def serve(serve_app: ServeApp) -> Serve:
    """Serve a scripted Triton: the endpoints the actuator calls."""

    async def start(triton: ScriptedTriton) -> str:
        app = web.Application()
        app.router.add_get(f"/v2/models/{MODEL}/config", triton.model_config)
        app.router.add_get(f"/v2/models/{MODEL}/ready", triton.model_ready)
        app.router.add_get("/v2/health/live", triton.live)
        app.router.add_post(f"/v2/repository/models/{MODEL}/load", triton.load)
        return await serve_app(app)

    return start


def bulk() -> rendering.Settings:
    profile = {"llm": {"batchSchedulerPolicy": "maxUtilization", "chunkedPrefill": True}}
    return rendering.render(specs.Profile.model_validate(profile))


def loaded_config(request: dict[str, Any]) -> dict[str, Any]:
    """The config override of a load request: Triton takes it as a JSON string."""
    assert list(request) == ["parameters"]
    assert list(request["parameters"]) == ["config"]  # no file overrides: the engine stays
    config: dict[str, Any] = json.loads(request["parameters"]["config"])
    return config


@pytest.mark.timeout(20)
async def test_the_load_request_carries_the_rendered_parameters_and_the_rest_unchanged(
    serve: Serve,
) -> None:
    triton = ScriptedTriton(REPOSITORY_CONFIG)
    async with servers.TritonServer(await serve(triton)) as server:
        applied = await actuators.apply_profile(
            server, MODEL, bulk(), profile="bulk", verify_timeout=5
        )
        again = await actuators.apply_profile(
            server, MODEL, bulk(), profile="bulk", verify_timeout=5
        )
    assert applied.reloaded
    assert applied.previous_profile is None
    assert not again.reloaded  # the served config already says so: nothing is sent
    (request,) = triton.load_requests
    assert loaded_config(request) == {
        **REPOSITORY_CONFIG,
        "parameters": {
            "gpt_model_type": {"string_value": "inflight_fused_batching"},
            "gpt_model_path": {"string_value": "/engines/llama/1-gpu"},
            "batch_scheduler_policy": {"string_value": "max_utilization"},
            "enable_chunked_context": {"string_value": "true"},
            "batchpilot.dev/profile": {"string_value": "bulk"},
            "batchpilot.dev/engine-arguments": {
                "string_value": (
                    '{"batch_scheduler_policy":"max_utilization","enable_chunked_context":"true"}'
                )
            },
            "batchpilot.dev/baseline-parameters": {
                "string_value": (
                    '{"batch_scheduler_policy":"guaranteed_no_evict",'
                    '"enable_chunked_context":"false"}'
                )
            },
        },
    }


@pytest.mark.timeout(20)
async def test_a_rejected_load_is_rolled_back_by_loading_the_served_config_again(
    serve: Serve,
) -> None:
    triton = ScriptedTriton(REPOSITORY_CONFIG)
    triton.reject_loads = 1
    async with servers.TritonServer(await serve(triton)) as server:
        with pytest.raises(actuators.ApplyFailed, match="UNAVAILABLE") as failed:
            await actuators.apply_profile(server, MODEL, bulk(), profile="bulk", verify_timeout=5)
    assert failed.value.rolled_back
    attempt, rollback = triton.load_requests
    assert loaded_config(attempt)["parameters"]["batch_scheduler_policy"] == {
        "string_value": "max_utilization"
    }
    assert loaded_config(rollback) == REPOSITORY_CONFIG
    assert triton.config == REPOSITORY_CONFIG


@pytest.mark.timeout(20)
async def test_a_profile_the_engine_cannot_take_is_refused_before_any_load(
    serve: Serve,
) -> None:
    triton = ScriptedTriton(REPOSITORY_CONFIG)
    seqs = rendering.render(specs.Profile.model_validate({"llm": {"maxNumSeqs": 8}}))
    async with servers.TritonServer(await serve(triton)) as server:
        with pytest.raises(overrides.ProfileRefused, match="no setting for maxNumSeqs"):
            await actuators.apply_profile(server, MODEL, seqs, profile="interactive")
    assert triton.load_requests == []
