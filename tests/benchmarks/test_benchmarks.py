"""The benchmarks in their short mode, for CI: they must run; their figures are printed, not
judged (`python -m pytest tests/benchmarks -m benchmark -s`, or `make bench-short`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import bench_policy
import bench_scale
import bench_sidecar
import bench_switch
import pytest

Main = Callable[[Sequence[str] | None], int]


def run_short(main: Main, capsys: pytest.CaptureFixture[str], *arguments: str) -> str:
    """Run a benchmark's command in short mode and show what it printed."""
    assert main(["--short", *arguments]) == 0
    report = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{report}", end="")
    return report


@pytest.mark.benchmark
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_policy_benchmark_short_mode(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_short(bench_policy.main, capsys)
    assert "batchpilot / best-static" in report


@pytest.mark.benchmark
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_switch_benchmark_short_mode(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_short(bench_switch.main, capsys)
    assert "zero failed requests across all switches" in report


@pytest.mark.benchmark
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_scale_benchmark_short_mode(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_short(bench_scale.main, capsys)
    assert "boundary -> live Pods serve" in report


@pytest.mark.benchmark
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_sidecar_benchmark_short_mode(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_short(bench_sidecar.main, capsys)
    assert "10 models tracked, 10 fitted" in report
