"""Calls through the synchronous Kubernetes client, each with a deadline on the whole call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def bounded(
    call: Callable[..., Any], /, *args: Any, read_timeout: float, **kwargs: Any
) -> Any:
    """`call(*args, **kwargs)` in a worker thread. The client's `_request_timeout` bounds each
    socket read, not the call, so the caller's wait is bounded too (TimeoutError)."""
    async with asyncio.timeout(read_timeout * 2):
        return await asyncio.to_thread(call, *args, _request_timeout=read_timeout, **kwargs)
