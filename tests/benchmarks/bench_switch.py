"""Switch cost through a real Service: a profile change reaching N Triton replicas under load, in
place or drained, as four kinds of client see it.

On the local Kubernetes cluster (`batchpilot_cluster`: a real API server, kube-proxy in nftables
mode,
Pods on its real node, run by the kubelet and containerd from this checkout's images, each in a
network namespace of its own that CNI's bridge plugin joins to the node's bridge)
N Pods serve `gpu_sim` behind a ClusterIP Service and the operator runs as a process, as its
ServiceAccount. Open-loop Poisson load comes from four clients (`batchpilot_testbed.clients`):

- `new-connection`, `keep-alive` (`tritonclient.http.aio`), `grpc` (`tritonclient.grpc.aio`):
  through the Service's cluster IP, from a client network namespace, so kube-proxy routes them;
- `endpoint-aware`: each request to a Ready Pod chosen when it is due
  (`batchpilot_testbed.balancing.ReadyBalancer`), as a service mesh or a gRPC xDS client does.

The policy then flips between `interactive` and `bulk` by its override, several times, in each of
two modes, on fresh Pods:

- `in-place`: Pods without the readiness gate; the operator reloads each replica while it
  serves, and the requests it holds wait for the reload;
- `drain`: Pods with the `batchpilot.dev/config-applied` readiness gate; the operator takes a
  replica out of its Services, waits for its queue to empty (or `rollout.drainTimeoutSeconds`:
  clients pinned to it keep it busy, which the operator reports as `DrainIneffective`),
  reloads it and puts it back.

The full mode adds a third, `drain, grpc age 1 s`: the gated Pods' Triton runs with
`--grpc-max-connection-age` (1 s), so that a gRPC client's connection ends a second after it
opened and the client reconnects, through the Service, to a Ready Pod.

All roll out one replica at a time (`rollout.maxUnavailable: 1`). The next switch comes a few
seconds after the last replica of the previous one switched. For each switch and client: the
time from the decision (the override accepted by the API server) to every replica serving the new
profile, the failed requests, and the p99 latency of the requests in flight at any time from the
decision until a second after the last replica switched, against the client's steady-state p99 of
the two profiles (the higher one). The full mode runs each client alone, so that the rollout time
is its own; the short mode runs the four at once, a quarter of the rate each.

    python tests/benchmarks/bench_switch.py           # 4 replicas, 4 switches, each client alone
    python tests/benchmarks/bench_switch.py --short   # CI: 2 replicas, 1 switch, all at once
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import benchmarking
import kubernetes.client

from batchpilot_cluster import controlplane, podnetwork
from batchpilot_harness import loadgen
from batchpilot_testbed import balancing, clients, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import endpoints, modelconfigs

POLICY = "fleet"
SERVICE = "triton"
CLIENTS = (*clients.STYLES, clients.BALANCED)
GRPC_AGE_MS = 1000
"""Triton's --grpc-max-connection-age in the mode that tries it: below the settle time (1.5 s)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    name: str
    slug: str
    """For names of namespaces and files."""
    gated: bool
    """The Pods carry the readiness gate: the operator drains them."""
    clients: tuple[str, ...] = CLIENTS
    grpc_max_connection_age_ms: int | None = None


MODES = (
    Mode(name="in-place", slug="in-place", gated=False),
    Mode(name="drain", slug="drain", gated=True),
)
GRPC_AGE = Mode(
    name=f"drain, grpc age {GRPC_AGE_MS / 1000:g} s",
    slug="drain-grpc-age",
    gated=True,
    clients=("grpc",),
    grpc_max_connection_age_ms=GRPC_AGE_MS,
)
"""What the full mode adds: Triton ends every gRPC connection after a second, so gRPC clients
reconnect, and kube-proxy routes them afresh."""
RATE = 200.0
"""Requests per second over the whole fleet."""
CATCH_UP_SECONDS = 1.0
"""A switch's requests: from the decision until this long after the last replica switched."""
WARM_UP_SECONDS = 2.0
"""Requests before this are left out of the steady state (connections being opened)."""
OPERATOR_INTERVAL = 2.0
HITLESS_RATIO = 1.2
STALL_MS = 250.0
"""A request slower than this waited for a reload: gpu_sim's steady p99 is below 40 ms, and a
reload holds a replica's requests for 0.5 s or more. A p99 over a long switch can hide a few
hundred of these among thousands, so they are counted apart."""
"""A switch is hitless when no request fails and its p99 is within this much of steady state."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    replicas: int
    switches: int
    steady_seconds: float
    """Load before the first switch."""
    settle_seconds: float
    """Load after each rollout, before the next switch."""
    drain_timeout_seconds: int
    together: bool
    """All clients at once (a share of the rate each), or one after another."""
    modes: tuple[Mode, ...] = MODES

    @property
    def rate(self) -> float:
        """Each client's rate."""
        return RATE / len(CLIENTS) if self.together else RATE

    @property
    def rollout_bound(self) -> float:
        """The longest a rollout may take: every replica drained until the timeout."""
        return self.replicas * (self.drain_timeout_seconds + 5.0) + 10.0

    def cells(self, mode: Mode) -> list[tuple[str, ...]]:
        """The clients of each run of switches in a mode."""
        return [mode.clients] if self.together else [(client,) for client in mode.clients]


def plan(*, short: bool, replicas: int | None) -> Plan:
    if short:
        return Plan(
            replicas=replicas or 2,
            switches=1,
            steady_seconds=5.0,
            settle_seconds=5.0,
            drain_timeout_seconds=4,
            together=True,
        )
    return Plan(
        replicas=replicas or 4,
        switches=4,
        steady_seconds=8.0,
        settle_seconds=10.0,
        drain_timeout_seconds=10,
        together=False,
        modes=(*MODES, GRPC_AGE),
    )


def policy(the_plan: Plan, override: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "target": {
            "selector": {"matchLabels": {"app": "triton"}},
            "port": "http",
            "models": [fleet.MODEL],
        },
        "profiles": fleet.PROFILES,
        "defaultProfile": "bulk",
        "minDwellSeconds": 0,
        "rollout": {
            "maxUnavailable": 1,
            "drainTimeoutSeconds": the_plan.drain_timeout_seconds,
        },
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
    kube: Kube, namespace: str, ips: dict[str, str], origin: float, the_plan: Plan
) -> list[Switch]:
    """Flip the profile `switches` times, each `settle_seconds` after the last rollout ended;
    the fleet serves bulk before and after."""
    switches = []
    current = "bulk"
    await asyncio.sleep(max(origin + the_plan.steady_seconds - time.monotonic(), 0.0))
    for _ in range(the_plan.switches):
        target = "interactive" if current == "bulk" else "bulk"
        await asyncio.to_thread(_override, kube, namespace, target)
        decided = time.monotonic() - origin
        served = await _follow(ips, target, origin, within=the_plan.rollout_bound)
        switches.append(Switch(source=current, target=target, decided=decided, served=served))
        current = target
        await asyncio.sleep(the_plan.settle_seconds)
    return switches


# -- one run of switches under the load of some clients --------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    records: dict[str, list[loadgen.RequestRecord]]
    """Per client."""
    switches: list[Switch]
    seconds: float
    drains_ineffective: list[str]
    """The DrainIneffective events of this run, in order."""


def run_switches(
    kube: Kube,
    served: Served,
    *,
    client_host: podnetwork.Host,
    balancer: balancing.ReadyBalancer,
    styles: Sequence[str],
    the_plan: Plan,
    seed: int,
) -> Run:
    namespace, ips = served.namespace, served.ips
    events_before = len(operators.events(kube, namespace, "DrainIneffective"))
    ports = {"grpc": endpoints.TRITON_GRPC_PORT}
    with contextlib.ExitStack() as stack:
        processes = {
            style: stack.enter_context(
                clients.ClientProcess(
                    client_host,
                    style=style,
                    address=f"{served.service_ip}:{ports.get(style, endpoints.TRITON_HTTP_PORT)}",
                    rate=the_plan.rate,
                    seed=seed + index,
                )
            )
            for index, style in enumerate(styles)
            if style != clients.BALANCED
        }
        origin = time.monotonic() + 0.2
        for process in processes.values():
            process.start(origin)

        async def switch_and_balance() -> tuple[list[Switch], list[loadgen.RequestRecord]]:
            """The switches, and the endpoint-aware client's load meanwhile if it takes part."""
            if clients.BALANCED not in styles:
                return await _switches(kube, namespace, ips, origin, the_plan), []
            chooser = random.Random(seed)

            def ready_pod() -> str | None:
                ready = balancer.ready
                return fleet.triton_url(chooser.choice(ready)) if ready else None

            stop = asyncio.Event()
            sender = clients.balanced(ready_pod)
            load = asyncio.create_task(
                clients.open_loop(
                    sender, rate=the_plan.rate, seed=seed + 99, origin=origin, stop=stop
                )
            )
            try:
                switches = await _switches(kube, namespace, ips, origin, the_plan)
            finally:
                stop.set()
                records = await load
                await sender.close()
            return switches, records

        switches, balanced_records = asyncio.run(switch_and_balance())
        seconds = time.monotonic() - origin
        records = {style: process.stop() for style, process in processes.items()}
    if clients.BALANCED in styles:
        records[clients.BALANCED] = balanced_records
    events = operators.events(kube, namespace, "DrainIneffective")
    return Run(
        records={style: records[style] for style in styles},
        switches=switches,
        seconds=seconds,
        drains_ineffective=events[events_before:],
    )


# -- analysis ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchReport:
    switch: Switch
    requests: int
    failed: int
    p99_ms: float | None
    steady_p99_ms: float | None
    slowest_ms: float | None
    stalled: int
    """Requests slower than STALL_MS."""

    @property
    def p99_ratio(self) -> float | None:
        return benchmarking.ratio(self.p99_ms, self.steady_p99_ms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellReport:
    """One client in one mode."""

    mode: str
    client: str
    together: bool
    requests: int
    failed: int
    steady_p99_ms: dict[str, float | None]
    steady_stalled: int
    """Requests slower than STALL_MS in steady state, with no switch under way."""
    switches: tuple[SwitchReport, ...]
    drains_ineffective: int
    """DrainIneffective events during its switches (with the others', when together)."""
    errors: tuple[str, ...]
    """A few of its failures."""
    timeline: benchmarking.Timeline

    @property
    def worst_ratio(self) -> float | None:
        return max((s.p99_ratio for s in self.switches if s.p99_ratio is not None), default=None)

    @property
    def stalled(self) -> int:
        """Requests of its switches that waited for a reload (slower than STALL_MS)."""
        return sum(s.stalled for s in self.switches)

    @property
    def hitless(self) -> bool:
        """No failed request, the p99 within HITLESS_RATIO of steady state at every switch, and
        no request stalled by a reload."""
        worst = self.worst_ratio
        ratio_met = worst is not None and worst <= HITLESS_RATIO
        return self.failed == 0 and ratio_met and self.stalled == 0


def _stalled(records: Sequence[loadgen.RequestRecord]) -> int:
    return sum(r.latency is not None and 1000 * r.latency > STALL_MS for r in records)


def analyse(
    mode: str,
    client: str,
    run: Run,
    the_plan: Plan,
) -> CellReport:
    """A switch's requests: those in flight at any time from its decision until the catch-up
    after its last replica. Steady state: the others (after the warm-up), by the profile every
    replica ran when they were sent."""
    records = run.records[client]
    switches = run.switches
    spans = []
    for switch in switches:
        end = (switch.converged or switch.decided + the_plan.rollout_bound) + CATCH_UP_SECONDS
        spans.append((switch.decided, end))
    during = [benchmarking.overlapping(records, start, end) for start, end in spans]
    touched = {id(record) for found in during for record in found}
    steady: dict[str, list[loadgen.RequestRecord]] = {name: [] for name in fleet.PROFILES}
    profiles = ["bulk", *(switch.target for switch in switches)]
    starts = [WARM_UP_SECONDS, *(end for _, end in spans)]
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
                slowest_ms=benchmarking.percentiles_ms(inside, (100,))[0],
                stalled=_stalled(inside),
            )
        )
    failures = [record.error or "failed" for record in records if not record.succeeded]
    return CellReport(
        mode=mode,
        client=client,
        together=the_plan.together,
        requests=len(records),
        failed=len(failures),
        steady_p99_ms=steady_p99,
        steady_stalled=sum(_stalled(found) for found in steady.values()),
        switches=tuple(reports),
        drains_ineffective=len(run.drains_ineffective),
        errors=tuple(failures[:3]),
        timeline=benchmarking.Timeline(
            label=f"{mode}, {client}",
            windows=tuple(benchmarking.windows(records, start=0.0, end=run.seconds, width=0.5)),
        ),
    )


# -- a mode: fresh Pods, a Service, the operator ------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Served:
    namespace: str
    ips: dict[str, str]
    """Pod name -> IP."""
    service_ip: str


@contextlib.contextmanager
def fleet_behind_a_service(
    kube: Kube, operator_kubeconfig: Path, mode: Mode, the_plan: Plan, out_dir: Path
) -> Iterator[Served]:
    """Fresh Pods behind a Service, every replica serving bulk and Ready, with the operator
    running; policies deleted at the end, while it still runs."""
    with benchmarking.namespace(kube, f"bench-switch-{mode.slug}") as namespace:
        ips = fleet.start_tritons(
            kube,
            namespace,
            the_plan.replicas,
            gated=mode.gated,
            grpc_max_connection_age_ms=mode.grpc_max_connection_age_ms,
        )
        service_ip = fleet.create_service(kube, namespace, selector={"app": "triton"}, name=SERVICE)
        operator = operators.OperatorProcess(
            kubeconfig=operator_kubeconfig,
            log_path=out_dir / f"switch-operator-{mode.slug}.log",
            namespaces=[namespace],
            interval=OPERATOR_INTERVAL,
        )
        try:
            waiting.wait_for("the operator's liveness", operator.healthy, timeout=60)
            operators.apply_policy(kube, namespace, policy(the_plan))
            waiting.wait_for(
                "bulk on every replica", fleet.everyone_serves(ips, "bulk"), timeout=120
            )
            waiting.wait_for(
                "every replica behind the Service",
                lambda: fleet.ready_endpoints(kube, namespace, SERVICE) == set(ips.values()),
                timeout=60,
            )
            yield Served(namespace=namespace, ips=ips, service_ip=service_ip)
            benchmarking.delete_policies(kube, namespace)
        finally:
            operator.stop()


def run_mode(
    kube: Kube,
    operator_kubeconfig: Path,
    client_host: podnetwork.Host,
    mode: Mode,
    the_plan: Plan,
    out_dir: Path,
) -> tuple[list[CellReport], dict[str, list[str]]]:
    """The mode's cells, and the gate history of each Pod."""
    reports: list[CellReport] = []
    with (
        fleet_behind_a_service(kube, operator_kubeconfig, mode, the_plan, out_dir) as served,
        balancing.ReadyBalancer(kube, served.namespace, served.ips) as balancer,
    ):
        for index, styles in enumerate(the_plan.cells(mode)):
            started = time.monotonic()
            run = run_switches(
                kube,
                served,
                client_host=client_host,
                balancer=balancer,
                styles=styles,
                the_plan=the_plan,
                seed=100 * index,
            )
            reports.extend(analyse(mode.name, style, run, the_plan) for style in styles)
            print(
                f"  {mode.name}, {' + '.join(styles)}: {time.monotonic() - started:.0f} s",
                flush=True,
            )
    return reports, balancer.gate_history


# -- reporting --------------------------------------------------------------------------------


def _range(values: Sequence[float | None], digits: int = 1) -> str:
    known = [value for value in values if value is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    if f"{low:.{digits}f}" == f"{high:.{digits}f}":
        return f"{low:.{digits}f}"
    return f"{low:.{digits}f}-{high:.{digits}f}"


def summary_rows(reports: Sequence[CellReport]) -> list[list[str]]:
    rows = []
    for report in reports:
        rows.append(
            [
                report.client,
                report.mode,
                f"{report.failed} of {report.requests}",
                f"{benchmarking.cell(report.steady_p99_ms['interactive'])} / "
                f"{benchmarking.cell(report.steady_p99_ms['bulk'])}",
                _range([s.p99_ms for s in report.switches], 0),
                benchmarking.cell(report.worst_ratio, 2),
                _range([s.slowest_ms for s in report.switches], 0),
                f"{report.stalled} / {report.steady_stalled}",
                _range([s.switch.seconds for s in report.switches]),
                str(report.drains_ineffective) if report.mode != "in-place" else "-",
                "yes" if report.hitless else "no",
            ]
        )
    return rows


SUMMARY_HEADERS = [
    "client",
    "mode",
    "failed",
    "steady p99 ms (interactive / bulk)",
    "p99 during a switch, ms",
    "worst p99 / steady",
    "slowest during a switch, ms",
    f"over {STALL_MS:g} ms: switches / steady",
    "rollout s",
    "DrainIneffective events",
    "hitless",
]


def render(
    reports: Sequence[CellReport],
    gate_history: dict[str, list[str]],
    the_plan: Plan,
    *,
    markdown: bool,
) -> str:
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    how = (
        f"the {len(CLIENTS)} clients at once, {the_plan.rate:g} req/s each"
        if the_plan.together
        else f"each client alone at {the_plan.rate:g} req/s"
    )
    lines = [
        f"{the_plan.replicas} Triton replicas (gpu_sim) behind a ClusterIP Service (kube-proxy, "
        f"nftables mode); {how}; operator timer {OPERATOR_INTERVAL:g} s, "
        f"rollout.maxUnavailable 1, drainTimeoutSeconds {the_plan.drain_timeout_seconds}; "
        f"{the_plan.switches} switches per client and mode",
        "",
    ]
    headers = [
        "client",
        "mode",
        "switch",
        "decision -> all serve (s)",
        "replicas served at (s after decision)",
        "req",
        "failed",
        "p99 ms",
        "steady p99 ms",
        "p99 / steady",
        "slowest ms",
        f"over {STALL_MS:g} ms",
    ]
    rows = []
    for report in reports:
        for item in report.switches:
            switch = item.switch
            rows.append(
                [
                    report.client,
                    report.mode,
                    f"{switch.source} -> {switch.target}",
                    benchmarking.cell(switch.seconds, 2),
                    " ".join(f"{at - switch.decided:.1f}" for at in sorted(switch.served.values()))
                    + ("" if len(switch.served) == the_plan.replicas else " (not all)"),
                    str(item.requests),
                    str(item.failed),
                    benchmarking.cell(item.p99_ms),
                    benchmarking.cell(item.steady_p99_ms),
                    benchmarking.cell(item.p99_ratio, 2),
                    benchmarking.cell(item.slowest_ms, 0),
                    str(item.stalled),
                ]
            )
    lines.append(tabulate(headers, rows))
    lines.append("")
    lines.append(tabulate(SUMMARY_HEADERS, summary_rows(reports)))
    lines.append("")
    failed = sum(r.failed for r in reports)
    lines.append(
        f"- zero failed requests across all switches: {failed} failed -> "
        + ("met" if failed == 0 else "MISSED")
    )
    for report in reports:
        if report.errors:
            lines.append(f"- {report.mode}, {report.client} failures: {list(report.errors)}")
    hitless = [f"{r.client} ({r.mode})" for r in reports if r.hitless]
    lines.append(
        f"- hitless (0 failed, p99 within {HITLESS_RATIO:g}x of steady state at every switch, "
        f"no request over {STALL_MS:g} ms during one): " + (", ".join(hitless) or "none")
    )
    closed = {pod: history.count("False") for pod, history in gate_history.items()}
    lines.append(f"- drain: times each Pod's readiness gate went False: {closed}")
    return "\n".join(lines)


def summary_json(
    reports: Sequence[CellReport], gate_history: dict[str, list[str]], the_plan: Plan
) -> dict[str, Any]:
    return {
        "plan": dataclasses.asdict(the_plan),
        "rate": RATE,
        "gate_history": gate_history,
        "cells": [
            {
                "mode": r.mode,
                "client": r.client,
                "together": r.together,
                "requests": r.requests,
                "failed": r.failed,
                "errors": list(r.errors),
                "steady_p99_ms": r.steady_p99_ms,
                "steady_stalled": r.steady_stalled,
                "drains_ineffective": r.drains_ineffective,
                "hitless": r.hitless,
                "switches": [
                    {
                        **dataclasses.asdict(s.switch),
                        "seconds": s.switch.seconds,
                        "requests": s.requests,
                        "failed": s.failed,
                        "p99_ms": s.p99_ms,
                        "steady_p99_ms": s.steady_p99_ms,
                        "slowest_ms": s.slowest_ms,
                        "stalled": s.stalled,
                    }
                    for s in r.switches
                ],
            }
            for r in reports
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Switch cost through a Service: in-place reload against the readiness-gate "
        "drain, for four kinds of client."
    )
    parser.add_argument(
        "--short", action="store_true", help="2 replicas, 1 switch, the clients at once"
    )
    parser.add_argument("--replicas", type=int, help="Triton Pods (default 4; --short: 2)")
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    the_plan = plan(short=arguments.short, replicas=arguments.replicas)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(
        f"switch-cost benchmark: {the_plan.replicas} replicas, {the_plan.switches} switches, "
        f"clients {', '.join(CLIENTS)} " + ("at once" if the_plan.together else "one by one"),
        flush=True,
    )
    reports: list[CellReport] = []
    gate_history: dict[str, list[str]] = {}
    with (
        benchmarking.operator_cluster(out_dir, "switch") as (kube, operator_kubeconfig),
        podnetwork.client_host(routes=controlplane.HOST_ROUTES) as client_host,
    ):
        for mode in the_plan.modes:
            found, history = run_mode(
                kube, operator_kubeconfig, client_host, mode, the_plan, out_dir
            )
            reports.extend(found)
            if mode == MODES[1]:
                gate_history = history
    order = [mode.name for mode in the_plan.modes]
    reports.sort(key=lambda r: (CLIENTS.index(r.client), order.index(r.mode)))
    benchmarking.write_summary(
        out_dir,
        "summary-switch",
        tables=functools.partial(render, reports, gate_history, the_plan),
        data=summary_json(reports, gate_history, the_plan),
    )
    plot = out_dir / "switch.png"
    benchmarking.plot_timelines(
        plot,
        timelines=[r.timeline for r in reports],
        title=f"p99 latency per 0.5 s over {the_plan.replicas} replicas; "
        "dotted: decisions, x: windows with failed requests",
        markers={
            r.timeline.label: [(s.switch.decided, f"-> {s.switch.target}") for s in r.switches]
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
