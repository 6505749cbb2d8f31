"""make test's account of its time: each test's phases recorded by the plugin, stages timed, and
a report that names the slowest tests with where their time went."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchpilot_harness import suite, suite_timings

SAMPLE = """
import pytest

@pytest.fixture
def cluster():
    yield "up"

def test_passes(cluster):
    assert cluster == "up"

def test_fails():
    assert 1 + 1 == 3, "arithmetic broke\\nsecond line"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


@pytest.mark.timeout(120)
def test_a_stage_records_every_test_and_the_report_counts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stage's pytest is no xdist worker, even when this test runs in one.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    folder = tmp_path / "timings"
    status = suite_timings.run_stage(
        folder,
        "sample",
        [
            sys.executable, "-m", "pytest", "-q", "-p", "batchpilot_harness.suite_timings",
            "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py"),
        ],
    )  # fmt: skip
    assert status == 1, "one test fails: the stage's status is pytest's"
    tests = {test.test.split("::")[-1]: test for test in suite_timings.read_tests(folder)}
    assert {name: test.outcome for name, test in tests.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
    }
    assert set(tests["test_passes"].phases) == {"setup", "call", "teardown"}
    assert tests["test_passes"].fixtures[:1] == ("cluster",)
    (stage,) = suite_timings.read_stages(folder)
    assert (stage.stage, stage.status) == ("sample", 1)
    text = suite_timings.report(folder)
    assert "  sample " in text
    assert "(exit 1)" in text
    assert "The 3 slowest of 3 tests" in text
    *_, counts, failed, reason = text.splitlines()
    assert counts == "suite: 1 passed, 1 failed, 1 skipped"
    assert failed.startswith("  failed: sample")
    assert failed.endswith("test_sample.py::test_fails"), "the tail names what failed"
    assert reason.strip().startswith("AssertionError: arithmetic broke | second line"), (
        "and why, on one line"
    )
    assert tests["test_fails"].reason == reason.strip()


def test_a_long_failure_reason_is_cut_to_one_short_line() -> None:
    report = pytest.TestReport(
        "test_x.py::test_y", ("test_x.py", 1, "test_y"), {}, "failed", "x\n" * 1000, "call"
    )
    reason = suite_timings.failure_reason(report)
    assert "\n" not in reason
    assert len(reason) <= suite_timings.REASON_CHARACTERS + 3


def test_without_the_folder_the_plugin_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text("def test_one():\n    pass\n")
    environment = {k: v for k, v in os.environ.items() if k != suite_timings.FOLDER_ENV}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "batchpilot_harness.suite_timings",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        env=environment, cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_sample.py"]


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        ({"setup": 40.0, "call": 2.0, "teardown": 1.0}, "setup 40 s (kube, triton_server)"),
        ({"setup": 0.1, "call": 12.0, "teardown": 0.2}, "its body 12 s"),
        ({"setup": 0.1, "call": 1.0, "teardown": 9.0}, "teardown 9 s"),
    ],
)
def test_a_test_waits_on_its_longest_phase(phases: dict[str, float], expected: str) -> None:
    test = suite_timings.TestTime(
        "e2e", "e2e/test_x.py::test_y", phases, "passed", ("kube", "triton_server")
    )
    assert test.waits_on() == expected


@pytest.mark.timeout(60)
def test_a_failed_stage_skips_only_the_stages_that_need_it_and_the_lane_fails(
    tmp_path: Path,
) -> None:
    lane = suite.Lane(
        "cluster",
        (
            suite.Stage("up", (sys.executable, "-c", "print('ran'); raise SystemExit(3)")),
            suite.Stage("e2e", (sys.executable, "-c", "print('should not run')"), needs=("up",)),
            suite.Stage("after e2e", ("true",), needs=("e2e",)),
            suite.Stage("tests", (sys.executable, "-c", "raise SystemExit(5)")),
            suite.Stage("down", ("true",)),
        ),
    )
    out = io.StringIO()
    status = suite.run_lane(tmp_path, lane, suite._Output(out))
    assert status == 3
    text = out.getvalue()
    assert "cluster | ran" in text
    assert "should not run" not in text
    assert "== e2e: not run, up failed" in text
    assert "== after e2e: not run, e2e failed" in text
    recorded = [(s.stage, s.status, s.lane) for s in suite_timings.read_stages(tmp_path)]
    assert recorded == [("up", 3, "cluster"), ("tests", 5, "cluster"), ("down", 0, "cluster")]


def test_the_plan_runs_the_cluster_wide_e2e_tests_alone_and_always_stops_the_cluster() -> None:
    for workers in (1, 2):
        (cluster,) = [lane for lane in suite.lanes(e2e_workers=workers) if lane.name == "cluster"]
        names = [stage.name for stage in cluster.stages]
        assert names[0] == "cluster up"
        assert names[-1] == "cluster down"
        assert not cluster.stages[-1].needs, "the cluster is stopped whatever failed"
        assert all(stage.needs == ("cluster up",) for stage in cluster.stages[1:-1])
        (e2e,) = [stage for stage in cluster.stages if stage.name == "e2e"]
        assert e2e.after == ("LLM tests",), "vLLM's engines beside the e2e Tritons crash them"
        shared, alone = (stage.command for stage in cluster.stages if stage.name.startswith("e2e"))
        assert "not cluster_wide" in shared
        assert ("-n" in shared) == (workers > 1)
        assert "cluster_wide" in alone
        assert "-n" not in alone
    # Every test of each suite is in one stage: the markers split, they do not drop.
    benchmarks = [
        stage.command[stage.command.index("-m", stage.command.index("tests/benchmarks")) + 1]
        for lane in suite.lanes()
        for stage in lane.stages
        if "tests/benchmarks" in stage.command
    ]
    assert sorted(benchmarks) == ["benchmark and cluster", "benchmark and not cluster"]
    stages = [stage for lane in suite.lanes() for stage in lane.stages]
    assert [stage.name for stage in stages if suite.LLM_TESTS in stage.command] == ["LLM tests"]
    (tests,) = [stage for stage in stages if stage.name == "tests"]
    assert f"--ignore={suite.LLM_TESTS}" in tests.command, "the LLM tests would run twice"


def test_the_report_gives_the_wall_clock_when_lanes_overlapped(tmp_path: Path) -> None:
    suite_timings.record_stage(tmp_path, "tests", 600, 0, lane="local")
    suite_timings.record_stage(tmp_path, "e2e", 900, 0, lane="cluster")
    suite_timings.record_suite(tmp_path, 960)
    text = suite_timings.report(tmp_path)
    assert "[cluster lane]" in text
    (wall,) = [line for line in text.splitlines() if "in all" in line]
    assert "(wall clock)" in wall
    assert wall.endswith(" 16.0 min"), wall


@pytest.mark.timeout(60)
def test_a_lane_whose_stage_a_signal_killed_fails_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    planned = (
        suite.Lane("local", (suite.Stage("tests", ("true",)),)),
        suite.Lane("cluster", (suite.Stage("e2e", (sys.executable, "-c", killed)),)),
    )
    monkeypatch.setattr(suite, "BEFORE_THE_LANES", ())
    monkeypatch.setattr(suite, "lanes", lambda **_: planned)
    out = io.StringIO()
    # Side by side and one after the other: a negative status (-9) is a failure, not less than 0.
    assert suite.run(tmp_path / "a", side_by_side=True, out=out) == -9
    assert suite.run(tmp_path / "b", side_by_side=False, out=out) == -9
    assert "== e2e: exit -9" in out.getvalue()


@pytest.mark.timeout(60)
def test_a_stage_starts_only_after_the_stage_of_the_other_lane_it_comes_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "engines-done"
    slow = f"import pathlib, time; time.sleep(1); pathlib.Path({str(marker)!r}).touch()"
    check = f"import pathlib; raise SystemExit(0 if pathlib.Path({str(marker)!r}).exists() else 7)"
    planned = (
        suite.Lane("local", (suite.Stage("engines", (sys.executable, "-c", slow)),)),
        suite.Lane(
            "cluster", (suite.Stage("e2e", (sys.executable, "-c", check), after=("engines",)),)
        ),
    )
    monkeypatch.setattr(suite, "BEFORE_THE_LANES", ())
    monkeypatch.setattr(suite, "lanes", lambda **_: planned)
    out = io.StringIO()
    assert suite.run(tmp_path / "timings", side_by_side=True, out=out) == 0
    assert "== e2e: waits for engines to end" in out.getvalue()
