"""Where `make test` spends its time: each stage, and the slowest tests with what they wait on.

The suite takes most of an hour on 2 cores, and most of that is waiting (reloads, clusters
started, Prometheus scrapes, schedule windows), not computing. Cutting it starts with knowing
where it goes, on every run, in CI's log:

- as a pytest plugin (`-p batchpilot_harness.suite_timings`, with $BATCHPILOT_TEST_TIMINGS
  naming a folder), each test's setup, call and teardown times are appended to a JSON-lines
  file of the stage, with the fixtures its setup ran: a slow setup is a fixture waited on (a
  cluster, a Triton, a Grafana), a slow call the test's own waiting;
- `python -m batchpilot_harness.suite_timings stage NAME -- COMMAND...` runs one stage of the
  suite and records its wall time;
- `python -m batchpilot_harness.suite_timings report` prints every stage's time and the 25
  slowest tests across stages, each with where its time went.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

FOLDER_ENV = "BATCHPILOT_TEST_TIMINGS"
STAGE_ENV = "BATCHPILOT_TEST_STAGE"
STAGES_FILE = "stages.jsonl"
SUITE_FILE = "suite.jsonl"
DEFAULT_FOLDER = Path(".run/test-timings")
SLOWEST = 25
REASON_CHARACTERS = 300
"""A failure's reason is cut here: CI's log tail must still show every failed test."""
_PHASES = ("setup", "call", "teardown")


def _folder() -> Path | None:
    configured = os.environ.get(FOLDER_ENV)
    return Path(configured) if configured else None


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


# -- the pytest plugin ------------------------------------------------------------------------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    folder = _folder()
    # Under pytest-xdist the controller hears every worker's reports: it alone records them.
    if folder is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    stage = os.environ.get(STAGE_ENV, "tests")
    record: dict[str, Any] = {
        "stage": stage,
        "test": report.nodeid,
        "phase": report.when,
        "seconds": round(report.duration, 3),
        "outcome": report.outcome,
    }
    if report.failed:
        record["reason"] = failure_reason(report)
    _append(folder / f"tests-{stage}.jsonl", record)


def failure_reason(report: pytest.TestReport) -> str:
    """What failed, on one line: the exception's message, as pytest's short summary gives it."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None) or report.longreprtext.strip().splitlines()[-1:]
    text = message if isinstance(message, str) else " ".join(message)
    one_line = " | ".join(part.strip() for part in text.splitlines() if part.strip())
    return one_line[:REASON_CHARACTERS] + ("..." if len(one_line) > REASON_CHARACTERS else "")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    folder = _folder()
    if folder is None:
        return
    # The fixtures the test asks for itself (a cluster, a Triton), not the autouse plumbing.
    info = getattr(item, "_fixtureinfo", None)
    requested: Sequence[str] = getattr(info, "argnames", ()) or getattr(item, "fixturenames", ())
    fixtures = [name for name in requested if not name.startswith("_")]
    _append(
        folder / f"fixtures-{os.environ.get(STAGE_ENV, 'tests')}.jsonl",
        {"test": item.nodeid, "fixtures": fixtures},
    )


# -- the report -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TestTime:
    stage: str
    test: str
    phases: dict[str, float]
    outcome: str
    """passed, failed or skipped: a failed or skipped setup is the test's outcome."""
    fixtures: tuple[str, ...] = ()
    reason: str = ""
    """Why it failed, when it did (the first failing phase's message)."""

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def waits_on(self) -> str:
        """Where its time went: the test's own body, or the fixtures its setup ran."""
        setup, call = self.phases.get("setup", 0.0), self.phases.get("call", 0.0)
        teardown = self.phases.get("teardown", 0.0)
        if setup >= max(call, teardown):
            named = ", ".join(self.fixtures[:4]) or "no fixture"
            return f"setup {setup:.0f} s ({named})"
        if teardown > call:
            return f"teardown {teardown:.0f} s"
        return f"its body {call:.0f} s"


def read_tests(folder: Path) -> list[TestTime]:
    phases: dict[tuple[str, str], dict[str, float]] = {}
    outcomes: dict[tuple[str, str], str] = {}
    reasons: dict[tuple[str, str], str] = {}
    fixtures: dict[str, tuple[str, ...]] = {}
    for path in sorted(folder.glob("fixtures-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            fixtures[record["test"]] = tuple(record["fixtures"])
    for path in sorted(folder.glob("tests-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            key = (record["stage"], record["test"])
            phases.setdefault(key, {})[record["phase"]] = float(record["seconds"])
            # The body's outcome, unless a setup or teardown failed, or the setup skipped it.
            decides = record["phase"] == "call" or record["outcome"] in ("failed", "skipped")
            if decides and outcomes.get(key) != "failed":
                outcomes[key] = record["outcome"]
            if record.get("reason"):
                reasons.setdefault(key, record["reason"])
    return [
        TestTime(
            stage,
            test,
            found,
            outcomes.get((stage, test), "passed"),
            fixtures.get(test, ()),
            reasons.get((stage, test), ""),
        )
        for (stage, test), found in phases.items()
    ]


@dataclasses.dataclass(frozen=True)
class StageTime:
    stage: str
    seconds: float
    status: int
    lane: str | None = None
    """The lane it ran in, when the suite ran lanes side by side (batchpilot_harness.suite)."""


def read_stages(folder: Path) -> list[StageTime]:
    path = folder / STAGES_FILE
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        StageTime(r["stage"], float(r["seconds"]), int(r["status"]), r.get("lane")) for r in records
    ]


def read_suite_seconds(folder: Path) -> float | None:
    """The whole suite's wall time, if it was recorded (lanes overlap: their sum is not it)."""
    path = folder / SUITE_FILE
    if not path.exists():
        return None
    return float(json.loads(path.read_text().splitlines()[-1])["seconds"])


def report(folder: Path, *, slowest: int = SLOWEST) -> str:
    stages = read_stages(folder)
    tests = read_tests(folder)
    lines = ["Where make test spent its time:"]
    for stage in stages:
        failed = "" if stage.status == 0 else f"  (exit {stage.status})"
        lane = f"  [{stage.lane} lane]" if stage.lane and stage.lane != "first" else ""
        lines.append(f"  {stage.stage:<24} {stage.seconds / 60:6.1f} min{lane}{failed}")
    wall = read_suite_seconds(folder)
    if wall is not None:
        lines.append(f"  {'in all (wall clock)':<24} {wall / 60:6.1f} min")
    elif stages:
        total = sum(stage.seconds for stage in stages)
        lines.append(f"  {'in all':<24} {total / 60:6.1f} min")
    by_stage: dict[str, float] = {}
    for test in tests:
        by_stage[test.stage] = by_stage.get(test.stage, 0.0) + test.seconds
    lines.append("")
    lines.append(
        f"The {min(slowest, len(tests))} slowest of {len(tests)} tests (setup + body + teardown):"
    )
    for test in sorted(tests, key=lambda t: t.seconds, reverse=True)[:slowest]:
        lines.append(f"  {test.seconds:7.1f} s  {test.stage:<10} {test.test}")
        lines.append(f"  {'':9}  {'':<10} waits on {test.waits_on()}")
    outcomes = [test.outcome for test in tests]
    lines += [
        "",
        f"suite: {outcomes.count('passed')} passed, {outcomes.count('failed')} failed, "
        f"{outcomes.count('skipped')} skipped",
    ]
    # Last, so that a CI log's tail names what failed, not only how many.
    failures = [test for test in tests if test.outcome == "failed"]
    for test in failures:
        lines.append(f"  failed: {test.stage:<10} {test.test}")
        if test.reason:
            lines.append(f"          {'':<10} {test.reason}")
    return "\n".join(lines)


# -- the command line -------------------------------------------------------------------------


def stage_environment(folder: Path, stage: str) -> dict[str, str]:
    """The environment of a stage's command: the plugin records into `folder` under `stage`."""
    return {**os.environ, FOLDER_ENV: str(folder), STAGE_ENV: stage}


def record_stage(
    folder: Path, stage: str, seconds: float, status: int, *, lane: str | None = None
) -> None:
    record: dict[str, Any] = {"stage": stage, "seconds": round(seconds, 1), "status": status}
    if lane is not None:
        record["lane"] = lane
    _append(folder / STAGES_FILE, record)


def record_suite(folder: Path, seconds: float) -> None:
    _append(folder / SUITE_FILE, {"seconds": round(seconds, 1)})


def reset(folder: Path) -> None:
    """Forget the timings of earlier runs."""
    for path in folder.glob("*.jsonl"):
        path.unlink()


def run_stage(
    folder: Path,
    stage: str,
    command: Sequence[str],
    *,
    lane: str | None = None,
    each_line: Callable[[str], None] | None = None,
) -> int:
    """Run one stage of the suite with the plugin's environment; record its wall time. With
    `each_line`, the command's output (stdout and stderr) goes to it line by line."""
    started = time.monotonic()
    environment = stage_environment(folder, stage)
    if each_line is None:
        status = subprocess.run(list(command), env=environment, check=False).returncode  # noqa: S603
    else:
        with subprocess.Popen(  # noqa: S603
            list(command),
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as process:
            assert process.stdout is not None
            for text in process.stdout:
                each_line(text)
        status = process.returncode
    record_stage(folder, stage, time.monotonic() - started, status, lane=lane)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_harness.suite_timings")
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    commands = parser.add_subparsers(dest="command", required=True)
    stage = commands.add_parser("stage", help="run one stage of the suite, timed")
    stage.add_argument("name")
    stage.add_argument("argv", nargs=argparse.REMAINDER)
    commands.add_parser("report", help="the stages' times and the slowest tests")
    commands.add_parser("reset", help="forget the timings of earlier runs")
    return parser


def _without_separator(argv: Iterable[str]) -> Iterator[str]:
    items = list(argv)
    yield from items[1:] if items[:1] == ["--"] else items


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    folder: Path = arguments.folder
    if arguments.command == "reset":
        reset(folder)
        return 0
    if arguments.command == "report":
        print(report(folder))
        return 0
    command = list(_without_separator(arguments.argv))
    if not command:
        print("suite_timings stage: no command given", file=sys.stderr)
        return 2
    return run_stage(folder, arguments.name, command)


if __name__ == "__main__":
    sys.exit(main())
