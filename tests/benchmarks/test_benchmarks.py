"""The benchmarks in their short mode, for CI: they must run; their figures are printed, not
judged (`python -m pytest tests/benchmarks -m benchmark -s`, or `make bench-short`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import bench_boundary
import bench_canary
import bench_chaos
import bench_drain
import bench_llm
import bench_policy
import bench_reload
import bench_scale
import bench_sidecar
import bench_switch
import benchmarking
import pytest

Main = Callable[[Sequence[str] | None], int]
ON_A_CLUSTER: tuple[Main, ...] = (
    bench_drain.main,
    bench_switch.main,
    bench_scale.main,
    bench_boundary.main,
    bench_chaos.main,
    bench_canary.main,
)
"""The benchmarks that run against a local control plane (marked `cluster`): they come last, and
share one (`make test` runs them on the e2e suite's cluster, after it)."""


@pytest.fixture(scope="module")
def one_local_cluster() -> Iterator[None]:
    """One local cluster for every benchmark that needs one, started at the first of them: a
    benchmark's `local_cluster()` uses the one that is up instead of starting its own."""
    with benchmarking.local_cluster():
        yield


@pytest.mark.benchmark
@pytest.mark.integration
@pytest.mark.parametrize(
    ("main", "expected"),
    [
        pytest.param(
            bench_policy.main,
            "batchpilot / best-static",
            id="policy",
            marks=pytest.mark.timeout(400),
        ),
        pytest.param(
            bench_llm.main,
            "batchpilot / best static bulk",
            id="llm",
            marks=pytest.mark.timeout(600),
        ),
        pytest.param(
            bench_reload.main,
            " grpc ",
            id="reload",
            marks=pytest.mark.timeout(180),
        ),
        pytest.param(
            bench_sidecar.main,
            "10 models tracked, 10 fitted",
            id="sidecar",
            marks=pytest.mark.timeout(180),
        ),
        pytest.param(
            bench_drain.main,
            "created -> Ready (Triton's readiness probe)",
            id="drain",
            marks=(pytest.mark.timeout(300), pytest.mark.cluster),
        ),
        pytest.param(
            bench_switch.main,
            "zero failed requests across all switches",
            id="switch",
            marks=(pytest.mark.timeout(400), pytest.mark.cluster),
        ),
        pytest.param(
            bench_scale.main,
            "boundary -> live Pods serve",
            id="scale",
            marks=(pytest.mark.timeout(400), pytest.mark.cluster),
        ),
        pytest.param(
            bench_boundary.main,
            "share of requests after the boundary on the old profile",
            id="boundary",
            marks=(pytest.mark.timeout(500), pytest.mark.cluster),
        ),
        pytest.param(
            bench_chaos.main,
            "targets left wrong at the end",
            id="chaos",
            marks=(pytest.mark.timeout(500), pytest.mark.cluster),
        ),
        pytest.param(
            bench_canary.main,
            "canary's share of replicas",
            id="canary",
            marks=(pytest.mark.timeout(400), pytest.mark.cluster),
        ),
    ],
)
def test_short_mode_exits_zero_and_prints_its_whole_report(
    main: Main, expected: str, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """Run a benchmark's command with --short and show what it printed; its report must be
    there in full (the last table's line), whatever its figures."""
    if main in ON_A_CLUSTER:
        request.getfixturevalue("one_local_cluster")
    assert main(["--short"]) == 0
    report = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{report}", end="")
    assert expected in report
