"""Benchmarks run when asked for (`-m benchmark`), not with every `pytest tests`."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "benchmark" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a benchmark: run it with -m benchmark")
    for item in items:
        if item.get_closest_marker("benchmark") is not None:
            item.add_marker(skip)
