"""The chaos soak's accounting on made-up faults, samples and records."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, cast

import bench_chaos

from batchpilot_harness import loadgen
from batchpilot_testbed import clients, faults, fleet


def test_the_schedule_alternates_every_window_from_the_next_minute() -> None:
    start = datetime.datetime(2026, 11, 23, 10, 58, 30, tzinfo=datetime.UTC)
    found = bench_chaos.windows(start, minutes=6)
    assert [(w["start"], w["end"]) for w in found[:2]] == [("10:59", "11:01"), ("11:03", "11:05")]
    assert bench_chaos.scheduled(found, start) == "bulk"
    assert bench_chaos.scheduled(found, start.replace(minute=59, second=1)) == "interactive"
    assert bench_chaos.scheduled(found, start.replace(hour=11, minute=1, second=0)) == "bulk"


def sample(at: float, served: str, gate: bool = True) -> bench_chaos.Sample:
    return bench_chaos.Sample(
        at=at, expected="bulk", served={"triton-0": served, "triton-1": "bulk"},
        gates={"triton-0": gate, "triton-1": True},
    )  # fmt: skip


def failed(pod_sent: float) -> loadgen.RequestRecord:
    return loadgen.RequestRecord(
        phase=0, scheduled=pod_sent, sent=pod_sent, latency=0.01, status=None, error="refused"
    )


def test_failures_count_inside_their_pod_s_fault_until_it_reconverged_and_outside_else() -> None:
    plan = bench_chaos.Plan(replicas=2, kinds=("triton-kill",), gap_seconds=30, hold_seconds=5)
    soak = bench_chaos.Soak(
        cast(Any, None), Path("."), "ns", {"triton-0": "a", "triton-1": "b"}, [], plan, Path(".")
    )
    soak.faults = [faults.Fault(kind="triton-kill", pod="triton-0", injected=110.0, healed=110.0)]
    soak.samples = [
        sample(100.0, "bulk"),
        sample(111.0, "unknown", gate=False),
        sample(118.0, "bulk", gate=False),
        sample(121.0, "bulk"),
    ]
    loads = clients.PodLoads(origin=100.0)
    loads.records = {
        "triton-0": [failed(12.0), failed(19.0), failed(25.0)],  # 112 and 119: inside; 125: out
        "triton-1": [failed(15.0)],
    }
    report = bench_chaos.analyse(soak, loads, switches=4, wrong=[], started=100.0)
    (kind,) = report.kinds
    assert kind.count == 1
    assert kind.reconverge_seconds == [11.0]
    assert kind.failed_inside == 2
    assert report.failed_outside == 2
    assert report.requests == 4
    text = bench_chaos.render(report, markdown=False)
    assert "failed outside faulted Pods: 2" in text
    assert "targets left wrong at the end: 0" in text


def test_the_report_names_every_restart_and_prints_the_last_lines_of_a_crash_not_a_kill() -> None:
    plan = bench_chaos.Plan(replicas=2, kinds=("triton-kill",), gap_seconds=30, hold_seconds=5)
    log = "\n".join(f"line {number}" for number in range(40)) + "\nSignal (11) received."
    killed = fleet.Restart(
        pod="triton-0", container="triton", count=1, exit_code=137, reason="Error",
        previous_log="killed's own lines",
    )  # fmt: skip
    crashed = fleet.Restart(
        pod="triton-1", container="triton", count=1, exit_code=139, reason="Error", previous_log=log
    )
    report = bench_chaos.Report(
        the_plan=plan, kinds=[], requests=0, failed_outside=0, failed_inside=0, switches=0,
        wrong_at_end=[], outside_examples=[], seconds=60.0, restarts=[killed, crashed],
    )  # fmt: skip
    text = bench_chaos.render(report, markdown=False)
    assert (
        "containers restarted: triton-0/triton restarted 1x, last run ended exit 137 (Error); "
        "triton-1/triton restarted 1x, last run ended exit 139 (Error)"
    ) in text
    assert "Signal (11) received." in text
    assert "line 26" in text  # its last 15 lines
    assert "line 25" not in text
    assert "killed's own lines" not in text
    assert bench_chaos.summary_json(report)["restarts"][1]["exit_code"] == 139
