"""Polling with a deadline, for tests that wait on an eventually consistent cluster."""

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(
    what: str, check: Callable[[], T | None], *, timeout: float = 30.0, interval: float = 0.2
) -> T:
    """Poll until check() returns something truthy and return it; fail naming what never came."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
