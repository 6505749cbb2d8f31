"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import web_apps


@pytest.fixture
async def serve_app() -> AsyncIterator[web_apps.ServeApp]:
    """Serve aiohttp apps on loopback ports for the test; each call gives the app's base URL."""
    async with web_apps.serving() as serve:
        yield serve
