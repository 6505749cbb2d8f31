"""Switch cost: a profile change reaching N Triton replicas under load, in place or drained.

On the local Kubernetes cluster (`e2e.cluster`: a real API server; kwok Pods whose tritonservers
the pod runner really runs), N Pods serve `gpu_sim` and the operator runs as a process, as its
ServiceAccount. Open-loop Poisson load goes to the Ready Pods only, as a Service would route it
(`e2e.balancing.ReadyBalancer`). The policy then flips between `interactive` and `bulk` by its
override, several times, and the same is done twice, on fresh Pods:

- `in-place`: Pods without the readiness gate; the operator reloads each replica while it
  serves, and its queued requests wait for the reload;
- `drain`: Pods with the `batchpilot.dev/config-applied` readiness gate; the operator takes a
  replica out of rotation, waits for its queue to empty, reloads it and puts it back.

Both roll out one replica at a time (`rollout.maxUnavailable: 1`). For each switch it reports the
time from the decision (the policy change accepted by the API server) to every replica serving
the new profile, when each replica got there, the failed requests and the p99 latency of the
requests in flight at any time from the decision until a second after the last replica switched
(a reload stalls the requests already queued), against the steady-state p99 of the two profiles
(the higher one: a switch to the slower profile is not charged for that profile's latency).

    python tests/benchmarks/bench_switch.py               # 4 replicas, 4 switches each way
    python tests/benchmarks/bench_switch.py --short       # CI: 2 replicas, 2 switches
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import benchmarking
import kubernetes.client
from e2e import balancing, fleet, operators, waiting
from e2e.kubes import Kube

from batchpilot_harness import loadgen
from batchpilot_triton import modelconfigs

POLICY = "fleet"
MODES = ("in-place", "drain")
RATE = 200.0
"""Requests per second over the whole fleet."""
CATCH_UP_SECONDS = 1.0
"""A switch's requests: from the decision until this long after the last replica switched."""
OPERATOR_INTERVAL = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    replicas: int
    switches: int
    steady_seconds: float
    """Load before the first switch."""
    period_seconds: float
    """From one switch to the next: the rollout, then steady state."""

    @property
    def seconds(self) -> float:
        return self.steady_seconds + self.switches * self.period_seconds

    def decision_offsets(self) -> list[float]:
        return [self.steady_seconds + k * self.period_seconds for k in range(self.switches)]


def plan(*, short: bool, replicas: int | None) -> Plan:
    if short:
        return Plan(replicas=replicas or 2, switches=2, steady_seconds=5.0, period_seconds=10.0)
    return Plan(replicas=replicas or 4, switches=4, steady_seconds=8.0, period_seconds=22.0)


def policy(override: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "target": {
            "selector": {"matchLabels": {"app": "triton"}},
            "port": "http",
            "models": [fleet.MODEL],
        },
        "profiles": fleet.PROFILES,
        "defaultProfile": "bulk",
        "minDwellSeconds": 0,
        "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 10},
    }
    if override is not None:
        spec["override"] = {"profile": override, "reason": "switch-cost benchmark"}
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "metadata": {"name": POLICY},
        "spec": spec,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Switch:
    source: str
    target: str
    decided: float
    """Offset of the decision: the override accepted by the API server."""
    served: dict[str, float]
    """Offset at which each replica first served the new profile."""

    @property
    def converged(self) -> float | None:
        return max(self.served.values()) if self.served else None

    @property
    def seconds(self) -> float | None:
        return None if self.converged is None else self.converged - self.decided


async def _served_profile(session: aiohttp.ClientSession, ip: str) -> tuple[str | None, int | None]:
    try:
        async with session.get(
            f"{fleet.triton_url(ip)}/v2/models/{fleet.MODEL}/config",
            timeout=aiohttp.ClientTimeout(total=2),
        ) as response:
            config = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None, None
    delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
    return modelconfigs.applied_profile(config), delay


async def _follow(
    ips: dict[str, str], profile: str, origin: float, within: float
) -> dict[str, float]:
    """When each replica first serves `profile` (offsets after `origin`)."""
    served: dict[str, float] = {}
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while len(served) < len(ips) and time.monotonic() < deadline:
            for pod, ip in ips.items():
                if pod in served:
                    continue
                if await _served_profile(session, ip) == (profile, fleet.QUEUE_DELAY[profile]):
                    served[pod] = time.monotonic() - origin
            await asyncio.sleep(0.05)
    return served


def _override(kube: Kube, namespace: str, profile: str) -> None:
    kubernetes.client.CustomObjectsApi(kube.api_client).patch_namespaced_custom_object(
        "batchpilot.dev",
        "v1alpha1",
        namespace,
        "batchpolicies",
        POLICY,
        {"spec": {"override": {"profile": profile, "reason": "switch-cost benchmark"}}},
    )


async def _switches(
    kube: Kube,
    namespace: str,
    ips: dict[str, str],
    balancer: balancing.ReadyBalancer,
    the_plan: Plan,
) -> list[Switch]:
    switches = []
    current = "bulk"
    await asyncio.sleep(0.2)  # let the balancer's drive start its clock
    for offset in the_plan.decision_offsets():
        await asyncio.sleep(max(balancer.started + offset - time.monotonic(), 0.0))
        target = "interactive" if current == "bulk" else "bulk"
        await asyncio.to_thread(_override, kube, namespace, target)
        decided = time.monotonic() - balancer.started
        served = await _follow(ips, target, balancer.started, within=the_plan.period_seconds - 1)
        switches.append(Switch(source=current, target=target, decided=decided, served=served))
        current = target
    return switches


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchReport:
    switch: Switch
    requests: int
    failed: int
    p99_ms: float | None
    steady_p99_ms: float | None

    @property
    def p99_ratio(self) -> float | None:
        return benchmarking.ratio(self.p99_ms, self.steady_p99_ms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeReport:
    mode: str
    replicas: int
    requests: int
    failed: int
    steady_p99_ms: dict[str, float | None]
    switches: tuple[SwitchReport, ...]
    gate_history: dict[str, list[str]]
    timeline: benchmarking.Timeline


def analyse(
    mode: str,
    the_plan: Plan,
    records: Sequence[loadgen.RequestRecord],
    switches: Sequence[Switch],
    gate_history: dict[str, list[str]],
) -> ModeReport:
    """A switch's requests: those in flight at any time from its decision until the catch-up
    after its last replica. Steady state: the others (after a 2 s warm-up), by the profile every
    replica ran when they were sent."""
    spans = []
    for switch in switches:
        end = (switch.converged or switch.decided + the_plan.period_seconds) + CATCH_UP_SECONDS
        spans.append((switch.decided, end))
    during = [benchmarking.overlapping(records, start, end) for start, end in spans]
    touched = {id(record) for found in during for record in found}
    steady: dict[str, list[loadgen.RequestRecord]] = {name: [] for name in fleet.PROFILES}
    profiles = ["bulk", *(switch.target for switch in switches)]
    starts = [2.0, *(end for _, end in spans)]
    for record in records:
        if id(record) in touched or record.scheduled < starts[0]:
            continue
        settled = sum(record.scheduled >= start for start in starts) - 1
        steady[profiles[settled]].append(record)
    steady_p99 = {
        name: benchmarking.percentiles_ms(found, (99,))[0] for name, found in steady.items()
    }
    reports = []
    for switch, inside in zip(switches, during, strict=True):
        references = [steady_p99[switch.source], steady_p99[switch.target]]
        known = [value for value in references if value is not None]
        reports.append(
            SwitchReport(
                switch=switch,
                requests=len(inside),
                failed=benchmarking.failures(inside),
                p99_ms=benchmarking.percentiles_ms(inside, (99,))[0],
                steady_p99_ms=max(known) if known else None,
            )
        )
    return ModeReport(
        mode=mode,
        replicas=the_plan.replicas,
        requests=len(records),
        failed=benchmarking.failures(records),
        steady_p99_ms=steady_p99,
        switches=tuple(reports),
        gate_history=gate_history,
        timeline=benchmarking.Timeline(
            label=mode,
            windows=tuple(
                benchmarking.windows(records, start=0.0, end=the_plan.seconds, width=0.5)
            ),
        ),
    )


def run_mode(
    kube: Kube, operator_kubeconfig: Path, mode: str, the_plan: Plan, out_dir: Path
) -> ModeReport:
    gated = mode == "drain"
    with benchmarking.namespace(kube, f"bench-switch-{mode}") as namespace:
        ips = fleet.start_tritons(kube, namespace, the_plan.replicas, gated=gated)
        operator = operators.OperatorProcess(
            kubeconfig=operator_kubeconfig,
            log_path=out_dir / f"switch-operator-{mode}.log",
            namespaces=[namespace],
            interval=OPERATOR_INTERVAL,
        )
        try:
            waiting.wait_for("the operator's liveness", operator.healthy, timeout=60)
            operators.apply_policy(kube, namespace, policy())

            waiting.wait_for(
                "bulk on every replica", fleet.everyone_serves(ips, "bulk"), timeout=120
            )
            waiting.wait_for(
                "every replica Ready",
                lambda: all(
                    fleet.pod_condition(kube, namespace, p, "Ready") == "True" for p in ips
                ),
                timeout=60,
            )
            with balancing.ReadyBalancer(kube, namespace, ips) as balancer:

                async def load_and_switch() -> tuple[list[loadgen.RequestRecord], list[Switch]]:
                    driving = asyncio.create_task(
                        balancer.drive([loadgen.Phase(rate=RATE, seconds=the_plan.seconds)])
                    )
                    switches = await _switches(kube, namespace, ips, balancer, the_plan)
                    return await driving, switches

                records, switches = asyncio.run(load_and_switch())
            benchmarking.delete_policies(kube, namespace)
        finally:
            operator.stop()
    return analyse(mode, the_plan, records, switches, balancer.gate_history)


# -- reporting --------------------------------------------------------------------------------


def render(reports: Sequence[ModeReport], the_plan: Plan, *, markdown: bool) -> str:
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    lines = [
        f"{the_plan.replicas} Triton replicas (gpu_sim), {RATE:g} req/s over the fleet, "
        f"operator timer {OPERATOR_INTERVAL:g} s, rollout.maxUnavailable 1; "
        f"{the_plan.switches} switches per mode",
        "",
    ]
    headers = [
        "mode",
        "switch",
        "decision -> all serve (s)",
        "replicas served at (s after decision)",
        "req",
        "failed",
        "p99 ms",
        "steady p99 ms",
        "p99 / steady",
    ]
    rows = []
    for report in reports:
        for item in report.switches:
            switch = item.switch
            rows.append(
                [
                    report.mode,
                    f"{switch.source} -> {switch.target}",
                    benchmarking.cell(switch.seconds, 2),
                    " ".join(f"{at - switch.decided:.1f}" for at in sorted(switch.served.values()))
                    + ("" if len(switch.served) == report.replicas else " (not all)"),
                    str(item.requests),
                    str(item.failed),
                    benchmarking.cell(item.p99_ms),
                    benchmarking.cell(item.steady_p99_ms),
                    benchmarking.cell(item.p99_ratio, 2),
                ]
            )
    lines.append(tabulate(headers, rows))
    lines.append("")
    summary_headers = [
        "mode",
        "requests",
        "failed (all run)",
        "steady p99 interactive ms",
        "steady p99 bulk ms",
        "worst switch p99 / steady",
        "slowest rollout s",
    ]
    summary_rows = []
    for report in reports:
        ratios = [s.p99_ratio for s in report.switches if s.p99_ratio is not None]
        seconds = [s.switch.seconds for s in report.switches if s.switch.seconds is not None]
        summary_rows.append(
            [
                report.mode,
                str(report.requests),
                str(report.failed),
                benchmarking.cell(report.steady_p99_ms["interactive"]),
                benchmarking.cell(report.steady_p99_ms["bulk"]),
                benchmarking.cell(max(ratios, default=None), 2),
                benchmarking.cell(max(seconds, default=None), 2),
            ]
        )
    lines.append(tabulate(summary_headers, summary_rows))
    lines.append("")
    drain = next((r for r in reports if r.mode == "drain"), None)
    failed = sum(r.failed for r in reports)
    lines.append(
        f"- zero failed requests across all switches: {failed} failed "
        f"({', '.join(f'{r.mode} {r.failed}' for r in reports)}) -> "
        + ("met" if failed == 0 else "MISSED")
    )
    if drain is not None:
        worst = max((s.p99_ratio for s in drain.switches if s.p99_ratio is not None), default=None)
        met = worst is not None and worst <= 1.2
        lines.append(
            f"- drain: p99 during a switch within 1.2x of steady state: worst "
            f"{benchmarking.cell(worst, 2)}x -> " + ("met" if met else "MISSED")
        )
        lines.append(f"- drain gate history per Pod: {drain.gate_history}")
    return "\n".join(lines)


def summary_json(reports: Sequence[ModeReport], the_plan: Plan) -> dict[str, Any]:
    return {
        "plan": dataclasses.asdict(the_plan),
        "rate": RATE,
        "modes": [
            {
                "mode": r.mode,
                "requests": r.requests,
                "failed": r.failed,
                "steady_p99_ms": r.steady_p99_ms,
                "gate_history": r.gate_history,
                "switches": [
                    {
                        **dataclasses.asdict(s.switch),
                        "seconds": s.switch.seconds,
                        "requests": s.requests,
                        "failed": s.failed,
                        "p99_ms": s.p99_ms,
                        "steady_p99_ms": s.steady_p99_ms,
                    }
                    for s in r.switches
                ],
            }
            for r in reports
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Switch cost: in-place reload against the readiness-gate drain."
    )
    parser.add_argument("--short", action="store_true", help="2 replicas, 2 switches per mode")
    parser.add_argument("--replicas", type=int, help="Triton Pods (default 4; --short: 2)")
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    the_plan = plan(short=arguments.short, replicas=arguments.replicas)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(
        f"switch-cost benchmark: {the_plan.replicas} replicas, {the_plan.switches} switches, "
        f"{the_plan.seconds:.0f} s of load per mode",
        flush=True,
    )
    reports = []
    with benchmarking.operator_cluster(out_dir, "switch") as (kube, operator_kubeconfig):
        for mode in MODES:
            mode_started = time.monotonic()
            reports.append(run_mode(kube, operator_kubeconfig, mode, the_plan, out_dir))
            print(f"  {mode}: done in {time.monotonic() - mode_started:.0f} s", flush=True)
    benchmarking.write_summary(
        out_dir,
        "summary-switch",
        tables=functools.partial(render, reports, the_plan),
        data=summary_json(reports, the_plan),
    )
    plot = out_dir / "switch.png"
    benchmarking.plot_timelines(
        plot,
        timelines=[r.timeline for r in reports],
        title=f"p99 latency per 0.5 s over {the_plan.replicas} replicas at {RATE:g} req/s; "
        "dotted: decisions, x: windows with failed requests",
        markers={
            r.mode: [(s.switch.decided, f"-> {s.switch.target}") for s in r.switches]
            for r in reports
        },
    )
    if arguments.publish:
        benchmarking.publish(out_dir, [plot.name, "summary-switch.md"])
    print(
        f"\nwrote {out_dir}/summary-switch.{{md,json}} and {plot}; "
        f"{time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
