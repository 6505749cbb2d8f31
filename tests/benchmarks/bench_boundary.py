"""A schedule boundary: is the new profile in force on every replica when the window opens?

On the local Kubernetes cluster (`batchpilot_cluster`), N Pods with the readiness gate serve
`gpu_sim`
and the operator runs as a process, as its ServiceAccount. Open-loop Poisson load goes to the
Ready Pods only, each request to one chosen when it is due
(`batchpilot_testbed.balancing.ReadyBalancer`, the
endpoint-aware client of the switch benchmark). A policy runs
`bulk` by default and opens an `interactive` window at a minute boundary; the same Pods meet one
such boundary per lead time, side by side:

- `schedule.leadTime: auto`: the change into the latency profile is decided early, by the
  policy's own measured rollout (its first rollout, to bulk, measures a wave);
- `schedule.leadTime: 0s`: it is decided at the boundary, and the drain rolls it out after.

For each it reports when every replica began serving `interactive` relative to the boundary
(first, median, last), and the share of the requests sent in the 20 s after the boundary that
went to a replica still on `bulk` (served under the old profile: the request was sent before that
replica switched), the failed requests, and the p99 of those requests.

    python tests/benchmarks/bench_boundary.py            # 8 replicas
    python tests/benchmarks/bench_boundary.py --short    # CI: 2 replicas
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import benchmarking

from batchpilot_harness import loadgen
from batchpilot_testbed import balancing, fleet, operators, waiting
from batchpilot_triton import modelconfigs

POLICY = "desk"
LEAD_TIMES = ("auto", "0s")
RATE = 100.0
"""Requests per second over the whole fleet."""
AFTER_SECONDS = 20.0
"""The requests judged: those sent this long after the boundary."""
OPERATOR_INTERVAL = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    replicas: int
    ahead_seconds: float
    """At least this long from the fleet running bulk to the boundary: more than any lead."""


def plan(*, short: bool, replicas: int | None) -> Plan:
    if short:
        return Plan(replicas=replicas or 2, ahead_seconds=20.0)
    return Plan(replicas=replicas or 8, ahead_seconds=60.0)


def policy(opens: datetime.datetime, lead_time: str) -> dict[str, Any]:
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "target": {
                "selector": {"matchLabels": {"app": "triton"}},
                "port": "http",
                "models": [fleet.MODEL],
            },
            "profiles": fleet.PROFILES,
            "defaultProfile": "bulk",
            "minDwellSeconds": 0,
            "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 10},
            "schedule": {
                "timezone": "UTC",
                "leadTime": lead_time,
                "windows": [
                    {
                        "profile": "interactive",
                        "start": opens.strftime("%H:%M"),
                        "end": (opens + datetime.timedelta(minutes=30)).strftime("%H:%M"),
                    }
                ],
            },
        },
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryReport:
    lead_time: str
    lead_seconds: float | None
    """The lead the operator planned (status.leadTimeSeconds)."""
    wave_seconds: float | None
    """The wave time it planned with (status.measuredWaveSeconds)."""
    served: dict[str, float]
    """When each replica first served interactive, seconds after the boundary."""
    requests_after: int
    old_profile_after: int
    """Requests sent after the boundary to a replica still on bulk."""
    failed: int
    p99_after_ms: float | None

    @property
    def old_share(self) -> float | None:
        return benchmarking.ratio(self.old_profile_after, self.requests_after)


async def _follow(ips: dict[str, str], origin: float, within: float) -> dict[str, float]:
    """When each replica first serves interactive (seconds after `origin`)."""
    served: dict[str, float] = {}
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:

        async def check(pod: str, ip: str) -> None:
            try:
                url = f"{fleet.triton_url(ip)}/v2/models/{fleet.MODEL}/config"
                async with session.get(url) as response:
                    config = await response.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return
            running = (config.get("parameters") or {}).get(modelconfigs.PROFILE_PARAMETER, {})
            delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
            if (
                running.get("string_value") == "interactive"
                and delay == fleet.QUEUE_DELAY["interactive"]
            ):
                served.setdefault(pod, time.monotonic() - origin)

        while len(served) < len(ips) and time.monotonic() < deadline:
            await asyncio.gather(*(check(p, ip) for p, ip in ips.items() if p not in served))
            await asyncio.sleep(0.05)
    return served


def analyse(
    lead_time: str,
    status: dict[str, Any],
    records: Sequence[loadgen.RequestRecord],
    boundary: float,
    served: dict[str, float],
    ips: dict[str, str],
) -> BoundaryReport:
    """`records` and `boundary` are offsets of the load's start."""
    pod_of = {fleet.triton_url(ip): pod for pod, ip in ips.items()}
    after = [
        r for r in records if r.sent is not None and boundary <= r.sent < boundary + AFTER_SECONDS
    ]
    old = [
        r
        for r in after
        if r.server is not None
        and r.sent is not None
        and r.sent - boundary < served.get(pod_of.get(r.server, ""), float("inf"))
    ]
    return BoundaryReport(
        lead_time=lead_time,
        lead_seconds=status.get("leadTimeSeconds"),
        wave_seconds=status.get("measuredWaveSeconds"),
        served=served,
        requests_after=len(after),
        old_profile_after=len(old),
        failed=benchmarking.failures(records),
        p99_after_ms=benchmarking.percentiles_ms(after, (99,))[0],
    )


def run_boundary(
    kube: Any,
    namespace: str,
    ips: dict[str, str],
    lead_time: str,
    the_plan: Plan,
) -> BoundaryReport:
    operators.apply_policy(kube, namespace, policy(_far_future(), lead_time))
    waiting.wait_for("bulk on every replica", fleet.everyone_serves(ips, "bulk"), timeout=180)
    waiting.wait_for(
        "every replica Ready",
        fleet.all_gates_open(kube, namespace, ips),
        timeout=60,
    )
    # The window opens at the first minute boundary far enough ahead for any lead.
    now = datetime.datetime.now(datetime.UTC)
    opens = (now + datetime.timedelta(seconds=the_plan.ahead_seconds)).replace(
        second=0, microsecond=0
    ) + datetime.timedelta(minutes=1)
    operators.apply_policy(kube, namespace, policy(opens, lead_time))
    status: dict[str, Any] = waiting.wait_for(
        "the rollout start planned",
        lambda: _planned(kube, namespace, opens),
        timeout=30,
    )
    starts = datetime.datetime.fromisoformat(status["plannedRolloutStart"])
    load_from = starts - datetime.timedelta(seconds=5)
    time.sleep(max((load_from - datetime.datetime.now(datetime.UTC)).total_seconds(), 0.0))
    seconds = (opens - load_from).total_seconds() + AFTER_SECONDS + 5
    with balancing.ReadyBalancer(kube, namespace, ips) as balancer:

        async def load_and_follow() -> tuple[list[loadgen.RequestRecord], dict[str, float], float]:
            driving = asyncio.create_task(
                balancer.drive([loadgen.Phase(rate=RATE, seconds=seconds)])
            )
            await asyncio.sleep(0.2)  # the drive has set its clock
            elapsed = time.monotonic() - balancer.started
            # The boundary as an offset of the load's start, on the load's own clock.
            boundary = (opens - datetime.datetime.now(datetime.UTC)).total_seconds() + elapsed
            served = await _follow(ips, balancer.started + boundary, within=seconds)
            return await driving, served, boundary

        records, served, boundary = asyncio.run(load_and_follow())
    benchmarking.delete_policies(kube, namespace)
    return analyse(lead_time, status, records, boundary, served, ips)


def _far_future() -> datetime.datetime:
    """A window that opens long after the run: the policy runs bulk meanwhile."""
    return datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=6)


def _planned(kube: Any, namespace: str, opens: datetime.datetime) -> dict[str, Any] | None:
    status = operators.policy_status(kube, namespace, POLICY)
    expected = opens.strftime("%Y-%m-%dT%H:%M:%SZ")
    if status.get("nextTransitionTime") == expected and status.get("plannedRolloutStart"):
        return status
    return None


def run(
    kube: Any, operator_kubeconfig: Path, the_plan: Plan, out_dir: Path
) -> list[BoundaryReport]:
    with benchmarking.namespace(kube, "bench-boundary") as namespace:
        ips = fleet.start_tritons(kube, namespace, the_plan.replicas, gated=True)
        operator = operators.OperatorProcess(
            kubeconfig=operator_kubeconfig,
            log_path=out_dir / "boundary-operator.log",
            namespaces=[namespace],
            interval=OPERATOR_INTERVAL,
        )
        try:
            waiting.wait_for("the operator's liveness", operator.healthy, timeout=60)
            reports = []
            for lead_time in LEAD_TIMES:
                started = time.monotonic()
                reports.append(run_boundary(kube, namespace, ips, lead_time, the_plan))
                print(f"  leadTime {lead_time}: done in {time.monotonic() - started:.0f} s")
        finally:
            operator.stop()
    return reports


def render(reports: Sequence[BoundaryReport], the_plan: Plan, *, markdown: bool) -> str:
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    lines = [
        f"{the_plan.replicas} Triton replicas (gpu_sim) with the readiness-gate drain, "
        f"rollout.maxUnavailable 1, {RATE:g} req/s over the fleet, operator timer "
        f"{OPERATOR_INTERVAL:g} s; a window opening interactive at a minute boundary",
        "",
    ]
    headers = [
        "leadTime",
        "planned lead s (wave s)",
        "replicas serve interactive at (s after the boundary: first / median / last)",
        f"requests in {AFTER_SECONDS:g} s after",
        "on the old profile",
        "failed",
        "p99 after ms",
    ]
    rows = []
    for report in reports:
        served = sorted(report.served.values())
        spread = (
            f"{served[0]:+.2f} / {served[len(served) // 2]:+.2f} / {served[-1]:+.2f}"
            + ("" if len(served) == the_plan.replicas else " (not all)")
            if served
            else "none"
        )
        share = None if report.old_share is None else 100 * report.old_share
        lead = benchmarking.cell(report.lead_seconds)
        rows.append(
            [
                report.lead_time,
                f"{lead} ({benchmarking.cell(report.wave_seconds, 2)})",
                spread,
                str(report.requests_after),
                f"{report.old_profile_after} ({benchmarking.cell(share)}%)",
                str(report.failed),
                benchmarking.cell(report.p99_after_ms),
            ]
        )
    lines.append(tabulate(headers, rows))
    lines.append("")
    auto = next((r for r in reports if r.lead_time == "auto"), None)
    if auto is not None:
        last = max(auto.served.values(), default=None)
        met = last is not None and last <= 0 and len(auto.served) == the_plan.replicas
        lines.append(
            f"- leadTime auto: every replica serves the new profile at or before the boundary: "
            f"last {benchmarking.cell(last, 2)} s -> " + ("met" if met else "MISSED")
        )
        lines.append(
            f"- leadTime auto: share of requests after the boundary on the old profile: "
            f"{auto.old_profile_after} of {auto.requests_after} -> "
            + ("met" if auto.old_profile_after == 0 else "MISSED")
        )
    failed = sum(r.failed for r in reports)
    lines.append(f"- failed requests: {failed} -> " + ("met" if failed == 0 else "MISSED"))
    return "\n".join(lines)


def summary_json(reports: Sequence[BoundaryReport], the_plan: Plan) -> dict[str, Any]:
    return {
        "plan": dataclasses.asdict(the_plan),
        "rate": RATE,
        "after_seconds": AFTER_SECONDS,
        "boundaries": [
            {**dataclasses.asdict(report), "old_share": report.old_share} for report in reports
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="A schedule boundary: leadTime auto against 0s, with the drain."
    )
    parser.add_argument("--short", action="store_true", help="2 replicas")
    parser.add_argument("--replicas", type=int, help="Triton Pods (default 8; --short: 2)")
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    the_plan = plan(short=arguments.short, replicas=arguments.replicas)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"boundary benchmark: {the_plan.replicas} replicas, leadTime {LEAD_TIMES}", flush=True)
    with benchmarking.operator_cluster(out_dir, "boundary") as (kube, operator_kubeconfig):
        reports = run(kube, operator_kubeconfig, the_plan, out_dir)
    benchmarking.write_summary(
        out_dir,
        "summary-boundary",
        tables=functools.partial(render, reports, the_plan),
        data=summary_json(reports, the_plan),
    )
    if arguments.publish:
        benchmarking.publish(out_dir, ["summary-boundary.md"])
    print(f"boundary benchmark: {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
