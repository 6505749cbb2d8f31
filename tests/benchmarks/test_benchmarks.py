"""The benchmarks in their short mode, for CI: they must run; their figures are printed, not
judged (`python -m pytest tests/benchmarks -m benchmark -s`)."""

from __future__ import annotations

import bench_sidecar
import pytest


@pytest.mark.benchmark
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_sidecar_benchmark_short_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_sidecar.main(["--short"]) == 0
    report = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{report}", end="")
    assert "10 models tracked, 10 fitted" in report
