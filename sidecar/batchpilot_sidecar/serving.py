"""The sidecar process: the collection loop, and /metrics, /status and /healthz in front of it;
and, when the Pod's model repository is mounted, `/v1/models/<model>/engine-arguments`: the
`model.json` the operator lays an LLM profile over, which it cannot read from the Pod itself.

`/healthz` answers whether the sidecar itself works — its loop collected recently — and not
whether Triton or the GPU answer: those are reported in /status, and restarting the sidecar
would not bring them back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Collection
from pathlib import Path

from aiohttp import web

from batchpilot_sidecar import (
    advising,
    collecting,
    gpus,
    llm_recommending,
    recommending,
    status_document,
    telemetry,
)
from batchpilot_triton import exposition, reports, repositories, servers

logger = logging.getLogger("batchpilot.sidecar")

HEALTHY_INTERVALS = 5
"""The loop is unhealthy once it has not completed a round for this many intervals."""
MIN_HEALTHY_SECONDS = 15.0


def application(
    collector: collecting.Collector,
    *,
    default_objective: recommending.Objective | None = None,
    default_llm_objective: llm_recommending.LlmObjective | None = None,
    started: float | None = None,
) -> web.Application:
    started_at = collector.clock() if started is None else started
    registry = telemetry.registry(
        collector,
        objective=lambda: default_objective,
        llm_objective=lambda: default_llm_objective,
    )

    async def status(request: web.Request) -> web.Response:
        try:
            objective = advising.parse_objective(request.query, default_objective)
            llm_objective = advising.parse_llm_objective(request.query, default_llm_objective)
        except ValueError as error:
            return web.json_response({"error": str(error)}, status=400)
        body = reports.as_json(status_document.document(collector, objective, llm_objective))
        return web.json_response(body, dumps=lambda value: json.dumps(value, indent=2))

    async def healthz(_: web.Request) -> web.Response:
        last = collector.last_tick if collector.last_tick is not None else started_at
        allowed = max(HEALTHY_INTERVALS * collector.settings.interval, MIN_HEALTHY_SECONDS)
        if collector.clock() - last > allowed:
            return web.Response(status=503, text=f"no collection for over {allowed:g}s\n")
        return web.Response(text="ok\n")

    async def engine_arguments(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        model_repository = collector.model_repository
        if model_repository is None:
            return web.json_response(
                {
                    "error": "this sidecar reads no model repository: start it with "
                    "--model-repository DIR (the Pod's repository, mounted read-only)"
                },
                status=404,
            )
        try:
            found = await collector.read_repository_arguments(model)
        except repositories.RepositoryError as error:
            return web.json_response({"error": str(error)}, status=_status_of(error))
        except TimeoutError as error:
            return web.json_response({"error": str(error)}, status=504)
        # Never a credential the file carries: anything that reaches this port could read it.
        served = repositories.without_credentials(found)
        return web.json_response({"model": model, **served.to_json()})

    app = web.Application()
    app.router.add_get("/metrics", exposition.metrics_handler(registry))
    app.router.add_get("/status", status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/models/{model}/engine-arguments", engine_arguments)
    return app


def _status_of(error: repositories.RepositoryError) -> int:
    if isinstance(error, repositories.InvalidModelName):
        return 400
    if isinstance(error, repositories.NotInRepository):
        return 404
    return 500


async def run_sidecar(
    *,
    triton_url: str,
    metrics_url: str | None,
    listen: tuple[str, int],
    settings: collecting.Settings,
    dcgm_url: str | None = None,
    pod: gpus.PodRef | None = None,
    default_objective: recommending.Objective | None = None,
    default_llm_objective: llm_recommending.LlmObjective | None = None,
    models: Collection[str] = (),
    model_repository: Path | None = None,
) -> int:
    """`batchpilot sidecar`: collect and serve until SIGTERM or Ctrl-C, then stop cleanly."""
    # A reading slower than the interval is late anyway; a little slack for busy servers.
    triton = servers.TritonServer(
        triton_url, metrics_url=metrics_url, request_timeout=max(2.0, settings.interval)
    )
    monitor = gpus.GpuMonitor(gpus.NvmlReader(), dcgm_url=dcgm_url, pod=pod)
    collector = collecting.Collector(
        triton, monitor, models=models, settings=settings, model_repository=model_repository
    )
    app = application(
        collector,
        default_objective=default_objective,
        default_llm_objective=default_llm_objective,
        started=time.monotonic(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    host, port = listen
    runner: web.AppRunner | None = None
    try:
        runner = await exposition.start(app, host=host, port=port)
        logger.info(
            "sidecar for %s (metrics %s) serving on %s:%d; every %gs",
            triton.url,
            triton.metrics_url,
            host,
            port,
            settings.interval,
        )
        await collector.run(stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if runner is not None:
            await runner.cleanup()
        await monitor.close()
        await triton.close()
    logger.info("stopped")
    return 0
