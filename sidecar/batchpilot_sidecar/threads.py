"""Blocking calls (NVML, reads of the mounted repository) in threads of their own, each with a
deadline, and at most one in flight per key.

A deadline ends the wait, not the call: a driver or a volume that hangs keeps its thread. So a
call still under way is waited on again rather than joined by another, and a hang costs one
thread per key, never one per tick. The threads are daemons, not the event loop's default
pool: `asyncio.run` and the interpreter join that pool's threads at exit without a deadline,
so one call stuck in a hung driver would keep the sidecar from ever ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
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
            pending = in_a_daemon_thread(function, *args)
            pending.add_done_callback(_retrieved)
            self._pending[key] = pending
        result: T = await asyncio.wait_for(asyncio.shield(pending), deadline)
        return result


def in_a_daemon_thread(function: Callable[..., T], /, *args: Any) -> asyncio.Future[T]:
    """`function(*args)` on a daemon thread of its own, as a future of the running loop: nothing
    joins the thread, so a call that never returns never holds the process at exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # else its waiter gave up and cancelled it
            outcome()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as error:  # handed to the waiter, whatever it is
            outcome = functools.partial(future.set_exception, error)
        else:
            outcome = functools.partial(future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed while the call hung
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(
        target=run, name=getattr(function, "__qualname__", "call"), daemon=True
    ).start()
    return future


def _retrieved(future: asyncio.Future[Any]) -> None:
    # A call that failed after its waiter gave up is not an unretrieved error: the next call
    # starts afresh.
    if not future.cancelled():
        with contextlib.suppress(Exception):
            future.exception()
