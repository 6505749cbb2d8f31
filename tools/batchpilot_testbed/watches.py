"""A Kubernetes watch followed from a thread while a test's block runs: states too short-lived
for polling to catch (a rollout's first seconds, a Pod Ready for a moment) are seen, in the API
server's order."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes.watch

WATCH_SECONDS = 600
"""The longest a test's watch runs; the API server ends it there."""


@contextlib.contextmanager
def followed(
    list_call: Callable[..., Any],
    *arguments: Any,
    on_event: Callable[[dict[str, Any]], None],
    what: str,
    **keywords: Any,
) -> Iterator[None]:
    """Watch `list_call(*arguments, **keywords)` from before the block until its end, each event
    to `on_event` (on the watch's thread); raises after the block if the watch broke."""
    watch = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
    started, stopping = threading.Event(), threading.Event()
    broken: list[Exception] = []

    def follow() -> None:
        stream = watch.stream(  # type: ignore[no-untyped-call]
            list_call,
            *arguments,
            timeout_seconds=WATCH_SECONDS,
            _request_timeout=WATCH_SECONDS + 10,
            **keywords,
        )
        started.set()
        try:
            for event in stream:
                on_event(event)
        except Exception as error:  # stopping closes the stream under the reader
            if not stopping.is_set():
                broken.append(error)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    started.wait(timeout=10)
    try:
        yield
    finally:
        stopping.set()
        watch.stop()  # type: ignore[no-untyped-call]
        follower.join(timeout=5)
    if broken:
        raise AssertionError(f"the watch of {what} broke: {broken[0]!r}")
