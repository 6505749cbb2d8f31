"""aiohttp apps served on loopback ports for a test (the `serve_app` fixture of tests/unit)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

ServeApp = Callable[[web.Application], Awaitable[str]]
"""Serve an app; its base URL."""


@asynccontextmanager
async def serving() -> AsyncIterator[ServeApp]:
    """Serve apps until the block ends, each on a loopback port of its own."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    try:
        yield start
    finally:
        for runner in runners:
            await runner.cleanup()
