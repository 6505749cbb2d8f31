"""The sidecar process: the collection loop, and /metrics, /status and /healthz in front of it.

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

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from batchpilot.triton import servers
from batchpilot_sidecar import collecting, gpus, recommending, statuses, telemetry

logger = logging.getLogger("batchpilot.sidecar")

HEALTHY_INTERVALS = 5
"""The loop is unhealthy once it has not completed a round for this many intervals."""
MIN_HEALTHY_SECONDS = 15.0


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` to serve on; an empty host means every address."""
    host, separator, port = text.rpartition(":")
    if not separator or not port.isdigit():
        raise ValueError(f"--listen {text!r}: expected HOST:PORT, e.g. 0.0.0.0:9400")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - the user asked for all


def application(
    collector: collecting.Collector,
    *,
    default_objective: recommending.Objective | None = None,
    started: float | None = None,
) -> web.Application:
    started_at = collector.clock() if started is None else started
    registry = telemetry.registry(collector, objective=lambda: default_objective)

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def status(request: web.Request) -> web.Response:
        try:
            objective = statuses.parse_objective(request.query, default_objective)
        except ValueError as error:
            return web.json_response({"error": str(error)}, status=400)
        body = statuses.document(collector, objective)
        return web.json_response(body, dumps=lambda value: json.dumps(value, indent=2))

    async def healthz(_: web.Request) -> web.Response:
        last = collector.last_tick if collector.last_tick is not None else started_at
        allowed = max(HEALTHY_INTERVALS * collector.settings.interval, MIN_HEALTHY_SECONDS)
        if collector.clock() - last > allowed:
            return web.Response(status=503, text=f"no collection for over {allowed:g}s\n")
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_get("/healthz", healthz)
    return app


async def run_sidecar(
    *,
    triton_url: str,
    metrics_url: str | None,
    listen: tuple[str, int],
    settings: collecting.Settings,
    dcgm_url: str | None = None,
    pod: str | None = None,
    default_objective: recommending.Objective | None = None,
    models: Collection[str] = (),
) -> int:
    """`batchpilot sidecar`: collect and serve until SIGTERM or Ctrl-C, then stop cleanly."""
    # A reading slower than the interval is late anyway; a little slack for busy servers.
    triton = servers.TritonServer(
        triton_url, metrics_url=metrics_url, request_timeout=max(2.0, settings.interval)
    )
    monitor = gpus.GpuMonitor(gpus.NvmlReader(), dcgm_url=dcgm_url, pod=pod)
    collector = collecting.Collector(triton, monitor, models=models, settings=settings)
    runner = web.AppRunner(
        application(collector, default_objective=default_objective, started=time.monotonic()),
        access_log=None,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    host, port = listen
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
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
        await runner.cleanup()
        await monitor.close()
        await triton.close()
    logger.info("stopped")
    return 0
