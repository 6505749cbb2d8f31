"""Configuration shared by all test suites."""

import asyncio
from collections.abc import Iterator

import pytest

# Real Triton servers for the integration tests, the demo and the benchmarks; Prometheus and
# Grafana for the dashboard and alert tests.
pytest_plugins = ["triton_fixtures", "prometheus_fixtures", "grafana_fixtures"]


@pytest.fixture(scope="session", autouse=True)
def _current_event_loop() -> Iterator[None]:
    """A current event loop that is closed at the end.

    Around every async test, pytest-asyncio 1.5 asks for the current loop to restore it later;
    with none set, that call creates one which nobody closes, and its ResourceWarning fails a
    later test (pytest-asyncio#724).
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()
