"""`make test`: what the whole suite runs, and in which order; and a faster form that runs it in
two lanes side by side.

After the linters and the builds, the suite has two lanes:

- the local lane: the benchmarks that need no cluster and the LLM tests first (they load the
  cores most), then the rest of `pytest tests` (unit, integration: local Tritons, Prometheus,
  Grafana, containerd);
- the cluster lane: one local cluster for everything that needs one. The cluster benchmarks
  first, then the e2e tests that keep to their own namespace, then those marked `cluster_wide`
  (they stop the control plane or the node, or install an operator that serves every
  namespace), with nothing else on the cluster. The cluster is stopped at the end, whatever
  failed.

By default the lanes run one after the other and the e2e tests one at a time: that is what has
passed on every landing. Most of the suite waits (reloads, rollouts, scrapes, windows), so
`--side-by-side` runs the two lanes at once and `--e2e-workers 2` runs the namespaced e2e tests
two at a time on the one cluster (pytest-xdist): about 20 minutes less, but on a quiet 2-core
machine two e2e tests that judge by timing failed that way (the canary's promotion and rollback,
the keep-alive drain): they must assert what batchpilot controls before it becomes the default.

A stage that fails ends its lane (the other lane goes on, so one run says everything that is
wrong); the cluster's stop runs anyway. Each stage is timed by `suite_timings`, and the end
prints where the time went. Each lane's lines are prefixed with its name.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
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


BUILDS = ("deps", "k8s-bins", "grafana", "llm-env", "numpy2-env", "images")

BEFORE_THE_LANES = (
    Stage("lint", (*MAKE, "lint")),
    # Side by side where their inputs allow (make -j): the Go builds share the cores, the LLM
    # environment and the images mostly wait on downloads and disk.
    Stage("builds", (*MAKE, "-j", "4", "--output-sync=line", *BUILDS)),
)

LLM_TESTS = "tests/integration/test_llm.py"
"""The vLLM engine on CPU takes both cores while it runs: side by side, these run while the
cluster lane runs its benchmarks (figures printed, nothing timed asserted), not beside the e2e
tests."""


def lanes(*, e2e_workers: int = 1) -> tuple[Lane, ...]:
    """The two lanes; with `e2e_workers` > 1 the namespaced e2e tests run that many at a time."""
    workers = ("-n", str(e2e_workers), "--dist", "load") if e2e_workers > 1 else ()
    # -v: a line per test as it ends, so the log shows the progress.
    e2e = (*PYTEST, "e2e", "--e2e", "-m", "not cluster_wide", *workers, "-v", "--durations=15")
    return (
        Lane(
            "local",
            (
                Stage(
                    "benchmarks",
                    (*PYTEST, "tests/benchmarks", "-m", "benchmark and not cluster", "-s"),
                ),
                Stage("LLM tests", (*PYTEST, LLM_TESTS)),
                Stage("tests", (*PYTEST, "tests", f"--ignore={LLM_TESTS}", "--durations=15")),
            ),
        ),
        Lane(
            "cluster",
            (
                Stage("cluster up", (PYTHON, "-m", "batchpilot_cluster", "up")),
                Stage(
                    "cluster benchmarks",
                    (*PYTEST, "tests/benchmarks", "-m", "benchmark and cluster", "-s"),
                ),
                Stage("e2e", e2e),
                Stage("e2e alone", (*PYTEST, "e2e", "--e2e", "-m", "cluster_wide", "-v")),
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
    status = suite_timings.run_stage(
        folder,
        stage.name,
        stage.command,
        lane=lane,
        each_line=lambda text: output.line(lane, text),
    )
    minutes = (time.monotonic() - started) / 60
    output.line(lane, f"== {stage.name}: exit {status} after {minutes:.1f} min")
    return status


def run_lane(folder: Path, lane: Lane, output: _Output) -> int:
    status = 0
    for stage in lane.stages:
        if status != 0 and not stage.always:
            output.line(lane.name, f"== {stage.name}: not run, an earlier stage failed")
            continue
        stage_status = _run_stage(folder, lane.name, stage, output)
        status = status or stage_status
    return status


def run(
    folder: Path,
    *,
    side_by_side: bool = False,
    e2e_workers: int = 1,
    out: TextIO = sys.stdout,
) -> int:
    suite_timings.reset(folder)
    output = _Output(out)
    started = time.monotonic()
    status = run_lane(folder, Lane("first", BEFORE_THE_LANES), output)
    if status == 0:
        planned = lanes(e2e_workers=e2e_workers)
        with concurrent.futures.ThreadPoolExecutor(len(planned) if side_by_side else 1) as pool:
            statuses = list(pool.map(lambda lane: run_lane(folder, lane, output), planned))
        # The first failure's status: a stage a signal killed has a negative one.
        status = next((lane_status for lane_status in statuses if lane_status != 0), 0)
    suite_timings.record_suite(folder, time.monotonic() - started)
    print(suite_timings.report(folder), file=out, flush=True)
    return status


def plan(*, side_by_side: bool = False, e2e_workers: int = 1) -> str:
    """The suite's plan, as `make -n test` cannot show it."""
    lines = [f"first: {stage.name}: {' '.join(stage.command)}" for stage in BEFORE_THE_LANES]
    how = "side by side" if side_by_side else "one after the other"
    for lane in lanes(e2e_workers=e2e_workers):
        lines.append(f"{how}, lane {lane.name}:")
        lines += [f"  {stage.name}: {' '.join(stage.command)}" for stage in lane.stages]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_harness.suite")
    parser.add_argument("--folder", type=Path, default=suite_timings.DEFAULT_FOLDER)
    parser.add_argument("--plan", action="store_true", help="print what would run, run nothing")
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the two lanes at the same time (faster; see this module's docstring)",
    )
    parser.add_argument(
        "--e2e-workers",
        type=int,
        default=1,
        help="run the namespaced e2e tests this many at a time on the one cluster (pytest-xdist)",
    )
    arguments = parser.parse_args(argv)
    side_by_side: bool = arguments.side_by_side
    e2e_workers: int = arguments.e2e_workers
    if arguments.plan:
        print(plan(side_by_side=side_by_side, e2e_workers=e2e_workers))
        return 0
    return run(arguments.folder, side_by_side=side_by_side, e2e_workers=e2e_workers)


if __name__ == "__main__":
    sys.exit(main())
