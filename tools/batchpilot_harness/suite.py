"""`make test`: what the whole suite runs, in which order, and what runs side by side.

Most of the suite's time is waiting (reloads, rollouts, Prometheus scrapes, schedule windows),
not computing, so it runs in two lanes at once once the linters and builds are done:

- the local lane: `pytest tests` (unit, integration: local Tritons, Prometheus, Grafana,
  containerd), then the benchmarks that need no cluster;
- the cluster lane: one local cluster for everything that needs one. The e2e tests that keep
  to their own namespace run two at a time on it (pytest-xdist); those marked `cluster_wide`
  (they stop the control plane or the node, or install an operator that serves every
  namespace) run after them, one at a time, with nothing else on the cluster; then the cluster
  benchmarks. The cluster is stopped at the end, whatever failed.

A stage that fails ends its lane (the other lane goes on, so one run says everything that is
wrong); the cluster's stop runs anyway. Each stage is timed by `suite_timings`, and the end
prints where the time went. Each lane's lines are prefixed with its name.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from batchpilot_harness import suite_timings

PYTHON = sys.executable
PYTEST = (PYTHON, "-m", "pytest", "-p", "batchpilot_harness.suite_timings")
MAKE = ("make", "--no-print-directory")
E2E_WORKERS = 2
"""The e2e tests that share the cluster run this many at a time: on 2 cores, each mostly waits
on rollouts and reloads (more workers add Triton Pods that compete for the same cores)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    command: tuple[str, ...]
    always: bool = False
    """Runs even after an earlier stage of its lane failed (the cluster's stop)."""


@dataclasses.dataclass(frozen=True)
class Lane:
    name: str
    stages: tuple[Stage, ...]


E2E_SIDE_BY_SIDE = (
    "e2e",
    "--e2e",
    "-m",
    "not cluster_wide",
    "-n",
    str(E2E_WORKERS),
    "--dist",
    "load",
)

BUILDS = ("deps", "k8s-bins", "grafana", "llm-env", "numpy2-env", "images")

BEFORE_THE_LANES = (
    Stage("lint", (*MAKE, "lint")),
    # Side by side where their inputs allow (make -j): the Go builds share the cores, the LLM
    # environment and the images mostly wait on downloads and disk.
    Stage("builds", (*MAKE, "-j", "4", "--output-sync=line", *BUILDS)),
)

LANES = (
    Lane(
        "local",
        (
            Stage("tests", (*PYTEST, "tests", "--durations=15")),
            Stage(
                "benchmarks",
                (*PYTEST, "tests/benchmarks", "-m", "benchmark and not cluster", "-s"),
            ),
        ),
    ),
    Lane(
        "cluster",
        (
            Stage("cluster up", (PYTHON, "-m", "batchpilot_cluster", "up")),
            Stage("e2e", (*PYTEST, *E2E_SIDE_BY_SIDE, "--durations=15")),
            Stage("e2e alone", (*PYTEST, "e2e", "--e2e", "-m", "cluster_wide", "--durations=10")),
            Stage(
                "cluster benchmarks",
                (*PYTEST, "tests/benchmarks", "-m", "benchmark and cluster", "-s"),
            ),
            Stage("cluster down", (PYTHON, "-m", "batchpilot_cluster", "down"), always=True),
        ),
    ),
)


class _Output:
    """One writer for the lanes' lines, each prefixed with its lane's name."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def line(self, lane: str, text: str) -> None:
        with self.lock:
            self.out.write(f"{lane:>7} | {text}")
            if not text.endswith("\n"):
                self.out.write("\n")
            self.out.flush()


def _run_stage(folder: Path, lane: str, stage: Stage, output: _Output) -> int:
    output.line(lane, f"== {stage.name}: {' '.join(stage.command)}")
    started = time.monotonic()
    with subprocess.Popen(  # noqa: S603 (commands are this module's constants)
        stage.command,
        env=suite_timings.stage_environment(folder, stage.name),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as process:
        assert process.stdout is not None
        for text in process.stdout:
            output.line(lane, text)
    seconds = time.monotonic() - started
    suite_timings.record_stage(folder, stage.name, seconds, process.returncode, lane=lane)
    output.line(lane, f"== {stage.name}: exit {process.returncode} after {seconds / 60:.1f} min")
    return process.returncode


def run_lane(folder: Path, lane: Lane, output: _Output) -> int:
    status = 0
    for stage in lane.stages:
        if status != 0 and not stage.always:
            output.line(lane.name, f"== {stage.name}: not run, an earlier stage failed")
            continue
        stage_status = _run_stage(folder, lane.name, stage, output)
        status = status or stage_status
    return status


def run(folder: Path, *, out: TextIO = sys.stdout) -> int:
    suite_timings.reset(folder)
    output = _Output(out)
    started = time.monotonic()
    status = run_lane(folder, Lane("first", BEFORE_THE_LANES), output)
    if status == 0:
        with concurrent.futures.ThreadPoolExecutor(len(LANES)) as pool:
            statuses = list(pool.map(lambda lane: run_lane(folder, lane, output), LANES))
        status = max(statuses)
    suite_timings.record_suite(folder, time.monotonic() - started)
    print(suite_timings.report(folder), file=out, flush=True)
    return status


def plan() -> str:
    """The suite's plan, as `make -n test` cannot show it."""
    lines = [f"then: {stage.name}: {' '.join(stage.command)}" for stage in BEFORE_THE_LANES]
    for lane in LANES:
        lines.append(f"side by side, lane {lane.name}:")
        lines += [f"  {stage.name}: {' '.join(stage.command)}" for stage in lane.stages]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_harness.suite")
    parser.add_argument("--folder", type=Path, default=suite_timings.DEFAULT_FOLDER)
    parser.add_argument("--plan", action="store_true", help="print what would run, run nothing")
    arguments = parser.parse_args(argv)
    if arguments.plan:
        print(plan())
        return 0
    return run(arguments.folder)


if __name__ == "__main__":
    sys.exit(main())
