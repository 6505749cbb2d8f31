"""`make test`: what the whole suite runs, and in which order: two lanes side by side.

After the linters and the builds, the suite has two lanes:

- the local lane: the benchmarks that need no cluster and the LLM tests first (they load the
  cores most), then the rest of `pytest tests` (unit, integration: local Tritons, Prometheus,
  Grafana, containerd);
- the cluster lane: one local cluster for everything that needs one. The cluster benchmarks
  first, then the e2e tests that keep to their own namespace, then those marked `cluster_wide`
  (they stop the control plane or the node, or install an operator that serves every
  namespace), with nothing else on the cluster. The cluster is stopped at the end, whatever
  failed.

The two lanes run side by side and the namespaced e2e tests two at a time on the one cluster
(pytest-xdist): most of the suite waits (reloads, rollouts, scrapes, windows), so this takes
about 20 minutes less than one thing at a time on 2 cores. Its tests assert what batchpilot
controls, never a figure the machine's load decides, so they hold on a busy machine too.
`--one-lane-at-a-time` and `--e2e-workers 1` give the slow form.

A stage runs unless a stage it needs failed (the e2e tests need the cluster's start), so one
run says everything that is wrong; the cluster's stop runs anyway; a failed lint skips the
rest. Each stage is timed by `suite_timings`, and the end prints where the time went. Each
lane's lines are prefixed with its name.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import sys
import threading
import time
from collections.abc import Mapping, Sequence
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
    needs: tuple[str, ...] = ()
    """The earlier stages of its lane that must have passed for it to run (the e2e tests need
    the cluster's start); any other failure does not stop it, so one run says all that fails."""
    after: tuple[str, ...] = ()
    """Stages of an earlier lane that must have ended, passed or not, before it starts: what
    must not run beside it."""


@dataclasses.dataclass(frozen=True)
class Lane:
    name: str
    stages: tuple[Stage, ...]


BUILDS = ("deps", "k8s-bins", "grafana", "llm-env", "numpy2-env", "images")

BEFORE_THE_LANES = (
    Stage("lint", (*MAKE, "lint")),
    # Side by side where their inputs allow (make -j): the Go builds share the cores, the LLM
    # environment and the images mostly wait on downloads and disk.
    Stage("builds", (*MAKE, "-j", "4", "--output-sync=line", *BUILDS), needs=("lint",)),
)

LLM_TESTS = "tests/integration/test_llm.py"
"""The vLLM engine on CPU takes both cores while it runs: side by side, these run while the
cluster lane runs its benchmarks (figures printed, nothing timed asserted), not beside the e2e
tests."""


E2E_WORKERS = 2
"""The namespaced e2e tests two at a time on the one cluster: most of each waits on rollouts,
reloads and windows, and both cores are busy with two (three left the tests starved)."""


def lanes(*, e2e_workers: int = E2E_WORKERS) -> tuple[Lane, ...]:
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
                    needs=("cluster up",),
                ),
                # Beside vLLM's engines on the same two cores, Tritons of the e2e tests crashed
                # in their Python backend during reloads (docs/tutorials/llm-fleet.md).
                Stage("e2e", e2e, needs=("cluster up",), after=("LLM tests",)),
                Stage(
                    "e2e alone",
                    (*PYTEST, "e2e", "--e2e", "-m", "cluster_wide", "-v"),
                    needs=("cluster up",),
                ),
                Stage("cluster down", (PYTHON, "-m", "batchpilot_cluster", "down")),
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


def run_lane(
    folder: Path, lane: Lane, output: _Output, ended: Mapping[str, threading.Event] | None = None
) -> int:
    """Its stages in order, each that its `needs` allow, each after the stages it comes `after`
    have ended (`ended`: every planned stage's, set when it ends); the first failure's status."""
    ended = ended or {}
    status = 0
    failed: set[str] = set()
    for stage in lane.stages:
        waited = [name for name in stage.after if name in ended and not ended[name].is_set()]
        if waited:
            output.line(lane.name, f"== {stage.name}: waits for {', '.join(waited)} to end")
            for name in waited:
                ended[name].wait()
        if missing := [need for need in stage.needs if need in failed]:
            output.line(lane.name, f"== {stage.name}: not run, {', '.join(missing)} failed")
            failed.add(stage.name)
        else:
            stage_status = _run_stage(folder, lane.name, stage, output)
            if stage_status != 0:
                failed.add(stage.name)
            status = status or stage_status
        if stage.name in ended:
            ended[stage.name].set()
    return status


def run(
    folder: Path,
    *,
    side_by_side: bool = True,
    e2e_workers: int = E2E_WORKERS,
    out: TextIO = sys.stdout,
) -> int:
    suite_timings.reset(folder)
    output = _Output(out)
    started = time.monotonic()
    status = run_lane(folder, Lane("first", BEFORE_THE_LANES), output)
    if status == 0:
        planned = lanes(e2e_workers=e2e_workers)
        ended = {stage.name: threading.Event() for lane in planned for stage in lane.stages}
        with concurrent.futures.ThreadPoolExecutor(len(planned) if side_by_side else 1) as pool:
            statuses = list(pool.map(lambda lane: run_lane(folder, lane, output, ended), planned))
        # The first failure's status: a stage a signal killed has a negative one.
        status = next((lane_status for lane_status in statuses if lane_status != 0), 0)
    suite_timings.record_suite(folder, time.monotonic() - started)
    print(suite_timings.report(folder), file=out, flush=True)
    return status


def plan(*, side_by_side: bool = True, e2e_workers: int = E2E_WORKERS) -> str:
    """The suite's plan, as `make -n test` cannot show it."""
    lines = [f"first: {stage.name}: {' '.join(stage.command)}" for stage in BEFORE_THE_LANES]
    how = "side by side" if side_by_side else "one after the other"
    for lane in lanes(e2e_workers=e2e_workers):
        lines.append(f"{how}, lane {lane.name}:")
        lines += [
            f"  {stage.name}: {' '.join(stage.command)}"
            + (f" (after {', '.join(stage.after)})" if stage.after else "")
            for stage in lane.stages
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_harness.suite")
    parser.add_argument("--folder", type=Path, default=suite_timings.DEFAULT_FOLDER)
    parser.add_argument("--plan", action="store_true", help="print what would run, run nothing")
    parser.add_argument(
        "--one-lane-at-a-time",
        action="store_true",
        help="run the lanes one after the other (slower; for a machine with one core)",
    )
    parser.add_argument(
        "--e2e-workers",
        type=int,
        default=E2E_WORKERS,
        help="run the namespaced e2e tests this many at a time on the one cluster (pytest-xdist;"
        " 1: one at a time)",
    )
    arguments = parser.parse_args(argv)
    side_by_side = not arguments.one_lane_at_a_time
    e2e_workers: int = arguments.e2e_workers
    if arguments.plan:
        print(plan(side_by_side=side_by_side, e2e_workers=e2e_workers))
        return 0
    return run(arguments.folder, side_by_side=side_by_side, e2e_workers=e2e_workers)


if __name__ == "__main__":
    sys.exit(main())
