"""Calls through the synchronous Kubernetes client have a deadline on the whole call."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from batchpilot.kube import calls


async def test_a_call_that_never_answers_ends_the_wait_at_its_deadline() -> None:
    release = threading.Event()
    seen: dict[str, Any] = {}

    def hangs(name: str, **kwargs: Any) -> None:
        seen.update(kwargs, name=name)
        release.wait(30)

    try:
        with pytest.raises(TimeoutError):
            await calls.bounded(hangs, "triton-0", read_timeout=0.05)
    finally:
        release.set()
    assert seen == {"name": "triton-0", "_request_timeout": 0.05}


async def test_an_answer_in_time_is_returned() -> None:
    assert await calls.bounded(lambda x, **_: x * 2, 21, read_timeout=5.0) == 42
