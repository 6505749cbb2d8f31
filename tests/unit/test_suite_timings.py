"""make test's account of its time: each test's phases recorded by the plugin, stages timed, and
a report that names the slowest tests with where their time went."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchpilot_harness import suite_timings

SAMPLE = """
import pytest

@pytest.fixture
def cluster():
    yield "up"

def test_passes(cluster):
    assert cluster == "up"

def test_fails():
    assert False

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


@pytest.mark.timeout(120)
def test_a_stage_records_every_test_and_the_report_counts_them(tmp_path: Path) -> None:
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
    assert (stage[0], stage[2]) == ("sample", 1)
    text = suite_timings.report(folder)
    assert "  sample " in text
    assert "(exit 1)" in text
    assert "The 3 slowest of 3 tests" in text
    assert text.splitlines()[-1] == "suite: 1 passed, 1 failed, 1 skipped"


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
