"""A Prometheus registry served over HTTP: the operator, the runner and the sidecar all export
their metrics through this one handler."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def metrics_handler(registry: CollectorRegistry) -> Handler:
    """A `GET /metrics` handler for `registry`, in Prometheus' text format."""

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics


async def healthy(_: web.Request) -> web.Response:
    """A `GET /healthz` answer for a process that is up."""
    return web.Response(text="ok\n")


async def start(app: web.Application, *, host: str, port: int) -> web.AppRunner:
    """Serve `app` until the returned runner is cleaned up; a port in use is a ValueError."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:
        await runner.cleanup()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return runner
