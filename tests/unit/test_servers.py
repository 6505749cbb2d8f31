"""TritonServer's long calls against a scripted HTTP server on loopback: a load may take long
while the server answers, and is given up once it stops answering."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from batchpilot_triton import servers


class Scripted:
    """A Triton whose loads take `load_seconds` and whose liveness answers while `live`."""

    def __init__(self, load_seconds: float, *, load_error: str | None = None) -> None:
        self.load_seconds = load_seconds
        self.load_error = load_error
        self.live = True
        self.liveness_checks = 0
        self.load_requests: list[dict[str, Any]] = []

    async def load(self, request: web.Request) -> web.Response:
        self.load_requests.append(await request.json())
        await asyncio.sleep(self.load_seconds)
        if self.load_error is not None:
            return web.json_response({"error": self.load_error}, status=400)
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        self.liveness_checks += 1
        if not self.live:
            await asyncio.sleep(3600)  # a cut-off server: no answer at all
        return web.Response()


Serve = Callable[["Scripted"], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(scripted: Scripted) -> str:
        app = web.Application()
        app.router.add_post("/v2/repository/models/{model}/load", scripted.load)
        app.router.add_get("/v2/health/live", scripted.health)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def quick(url: str) -> servers.TritonServer:
    return servers.TritonServer(
        url, request_timeout=0.2, load_timeout=30, liveness_interval=0.1, liveness_misses=3
    )


@pytest.mark.timeout(10)
async def test_a_long_load_on_a_server_that_answers_runs_to_its_end(serve: Serve) -> None:
    scripted = Scripted(load_seconds=1.0)
    async with quick(await serve(scripted)) as triton:
        await triton.load("gpu_sim")
    assert scripted.liveness_checks >= 3  # it was checked on, and never given up


@pytest.mark.timeout(10)
async def test_a_load_on_a_server_that_stops_answering_is_given_up_as_unreachable(
    serve: Serve,
) -> None:
    scripted = Scripted(load_seconds=3600)
    async with quick(await serve(scripted)) as triton:
        scripted.live = False
        with pytest.raises(servers.Unreachable, match="3 liveness checks missed in a row"):
            await triton.load("gpu_sim")


@pytest.mark.timeout(10)
async def test_a_load_with_files_sends_them_base64_encoded_beside_the_config(
    serve: Serve,
) -> None:
    scripted = Scripted(load_seconds=0)
    files = {"file:1/model.json": b'{"max_num_seqs": 4}'}
    async with quick(await serve(scripted)) as triton:
        await triton.load("tiny_llm", {"backend": "vllm"}, files=files)
    (request,) = scripted.load_requests
    parameters = request["parameters"]
    assert json.loads(parameters["config"]) == {"backend": "vllm"}
    assert base64.b64decode(parameters["file:1/model.json"]) == files["file:1/model.json"]


@pytest.mark.timeout(10)
async def test_a_load_with_files_that_triton_refuses_is_rejected_with_its_reason(
    serve: Serve,
) -> None:
    scripted = Scripted(load_seconds=0, load_error="failed to load 'tiny_llm': bad engine args")
    async with quick(await serve(scripted)) as triton:
        with pytest.raises(servers.LoadRejected, match="bad engine args"):
            await triton.load("tiny_llm", {"backend": "vllm"}, files={"file:1/model.json": b"{}"})


@pytest.mark.timeout(10)
async def test_a_server_closed_under_a_caller_answers_its_next_call(serve: Serve) -> None:
    """A caller that still holds a closed server (a runner's last tick after its owner closed
    it) gets a fresh session, not aiohttp's 'Session is closed'."""
    scripted = Scripted(load_seconds=0.0)
    triton = quick(await serve(scripted))
    await triton.load("gpu_sim")
    # The close has begun (its session says closed) when the load asks for one.
    await asyncio.gather(triton.close(), triton.load("gpu_sim"))
    await triton.close()
    assert len(scripted.load_requests) == 2
