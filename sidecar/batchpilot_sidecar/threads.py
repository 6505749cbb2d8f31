"""Blocking calls (NVML, reads of the mounted repository) in worker threads, each with a
deadline, and at most one in flight per key.

A deadline ends the wait, not the call: a driver or a volume that hangs keeps its thread. So a
call still under way is waited on again rather than joined by another, and a hang costs one
thread per key, never one per tick, which would empty the pool every other call needs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class OneAtATime:
    def __init__(self) -> None:
        self._pending: dict[Hashable, asyncio.Future[Any]] = {}

    async def call(
        self, key: Hashable, deadline: float, function: Callable[..., T], /, *args: Any
    ) -> T:
        """`function(*args)` in a thread, or the call for `key` still under way; TimeoutError
        after `deadline` seconds of waiting."""
        pending = self._pending.get(key)
        if pending is None or pending.done():
            pending = asyncio.ensure_future(asyncio.to_thread(function, *args))
            pending.add_done_callback(_retrieved)
            self._pending[key] = pending
        result: T = await asyncio.wait_for(asyncio.shield(pending), deadline)
        return result


def _retrieved(future: asyncio.Future[Any]) -> None:
    # A call that failed after its waiter gave up is not an unretrieved error: the next call
    # starts afresh.
    if not future.cancelled():
        with contextlib.suppress(Exception):
            future.exception()
