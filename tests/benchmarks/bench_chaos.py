"""A chaos soak: minutes of load, schedule boundaries and random faults; is the fleet right?

On the local Kubernetes cluster (`batchpilot_cluster`), gated Triton Pods serve `gpu_sim` and the
operator runs as a process, as its ServiceAccount. The policy's schedule alternates
`interactive` and `bulk` every two minutes, and a load rule whose signal comes from the sidecars
(so a hung sidecar matters) never fires at this load. Each Pod gets a keep-alive client of its
own, so every failed request belongs to the Pod it was sent to.

Every `gap` seconds one fault from `batchpilot_testbed.faults.KINDS` is injected, each kind in turn
(shuffled,
so that all come round equally often), on a random Pod where it hits one, and healed after
`hold` seconds where it does not heal itself. Once a second the soak samples what every Pod
serves, its gate, and what the policy should be on: the schedule's profile, or a policy edit's
override. It reports:

- per fault kind: how often, and the time to reconverge (from the fault's end until every Pod
  serves the profile it should, its gate True), median and worst;
- failed requests inside the faulted Pods (sent while the Pod was faulted, until it
  reconverged) and outside them: the target is 0 outside;
- the switches the operator made, and the targets left wrong at the end (after up to 2 minutes
  without faults): the target is 0.

    python tests/benchmarks/bench_chaos.py            # 30 minutes, 3 replicas, every kind 3 times
    python tests/benchmarks/bench_chaos.py --short    # CI: 2 faults, 2 replicas
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import benchmarking

from batchpilot_cluster import controlplane, podnetwork
from batchpilot_testbed import clients, faults, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube

WINDOW_MINUTES = 2
"""The schedule flips between interactive and bulk this often."""
RATE = 20.0
"""Requests per second to each Pod."""
OPERATOR_INTERVAL = 2.0
SAMPLE_SECONDS = 1.0
FINAL_WAIT_SECONDS = 120.0
PREVIOUS_LOG_LINES = 80
CRASH_LOG_LINES = 15
"""Of a container that ended other than by a kill, the last lines the report prints."""
KILLED = 137
"""128 + SIGKILL: how a triton-kill fault's container ends."""
SHORT_KINDS = ("network-cut", "triton-kill")
"""CI's smoke run: a fault that heals and one that restarts a Pod's server. The e2e suite
restarts the API server and etcd, and kills the operator mid-rollout, on its own."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    replicas: int
    kinds: tuple[str, ...]
    """The faults, in the order injected."""
    gap_seconds: float
    """From one fault's start to the next."""
    hold_seconds: float
    """How long a fault that needs healing lasts."""

    @property
    def seconds(self) -> float:
        return len(self.kinds) * self.gap_seconds


def plan(*, short: bool, minutes: float | None, replicas: int | None, seed: int) -> Plan:
    if short:
        return Plan(replicas=replicas or 2, kinds=SHORT_KINDS, gap_seconds=35.0, hold_seconds=10.0)
    rounds = 3
    kinds: list[str] = []
    shuffler = random.Random(seed)
    for _ in range(rounds):
        batch = list(faults.KINDS)
        shuffler.shuffle(batch)
        kinds.extend(batch)
    total = (minutes or 30.0) * 60
    return Plan(
        replicas=replicas or 3,
        kinds=tuple(kinds),
        gap_seconds=total / len(kinds),
        hold_seconds=15.0,
    )


def windows(start: datetime.datetime, minutes: float) -> list[dict[str, Any]]:
    """Interactive windows every other WINDOW_MINUTES, from the next boundary on."""
    first = start.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    found = []
    at = first
    while at < start + datetime.timedelta(minutes=minutes + 2 * WINDOW_MINUTES):
        end = at + datetime.timedelta(minutes=WINDOW_MINUTES)
        found.append(
            {"profile": "interactive", "start": at.strftime("%H:%M"), "end": end.strftime("%H:%M")}
        )
        at = end + datetime.timedelta(minutes=WINDOW_MINUTES)
    return found


def scheduled(found: Sequence[dict[str, Any]], at: datetime.datetime) -> str:
    """The schedule's profile at `at` (UTC): interactive inside a window."""
    clock = at.strftime("%H:%M")
    inside = any(window["start"] <= clock < window["end"] for window in found)
    return "interactive" if inside else "bulk"


def spec(found: Sequence[dict[str, Any]], override: dict[str, Any] | None) -> dict[str, Any]:
    never = {"profile": "bulk", "metric": "requestRate", "above": 100_000, "for": "5s"}
    return {
        "rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 10},
        "schedule": {"timezone": "UTC", "windows": list(found), "leadTime": "0s"},
        "load": {"source": "sidecar", "rules": [never]},
        **({"override": override} if override else {}),
    }


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float
    """time.monotonic()"""
    expected: str
    served: dict[str, str | None]
    gates: dict[str, bool]

    @property
    def converged(self) -> bool:
        return all(profile == self.expected for profile in self.served.values()) and all(
            self.gates.values()
        )

    def wrong(self) -> list[str]:
        return sorted(
            pod
            for pod in self.served
            if self.served[pod] != self.expected or not self.gates.get(pod)
        )


class Soak:
    """The fleet, its operator, and what the soak has seen of them."""

    def __init__(
        self,
        kube: Kube,
        operator_kubeconfig: Path,
        namespace: str,
        ips: dict[str, str],
        found_windows: list[dict[str, Any]],
        the_plan: Plan,
        out_dir: Path,
    ) -> None:
        self.kube = kube
        self.the_plan = the_plan
        self.operator_kubeconfig = operator_kubeconfig
        self.namespace = namespace
        self.ips = ips
        self.windows = found_windows
        self.out_dir = out_dir
        self.operators: list[operators.OperatorProcess] = []
        self.faults: list[faults.Fault] = []
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # -- the operator and the policy

    def operator(self, kill: bool) -> None:
        if kill:
            self.operators[-1].kill()
            return
        process = operators.OperatorProcess(
            kubeconfig=self.operator_kubeconfig,
            log_path=self.out_dir / f"chaos-operator-{len(self.operators)}.log",
            namespaces=[self.namespace],
            interval=OPERATOR_INTERVAL,
        )
        self.operators.append(process)
        waiting.wait_for("the operator's liveness", process.healthy, timeout=60)

    def edit_policy(self, override: dict[str, Any] | None) -> None:
        operators.apply_policy(
            self.kube, self.namespace, fleet.policy(**spec(self.windows, override))
        )

    def expected(self, now: datetime.datetime) -> str:
        with self._lock:
            edits = [fault.override for fault in self.faults if fault.override is not None]
        for profile, until in reversed(edits):
            if now < until:
                return profile
        return scheduled(self.windows, now)

    # -- sampling

    def sample(self) -> Sample:
        at = time.monotonic()
        expected = self.expected(datetime.datetime.now(datetime.UTC))
        served = {pod: fleet.served_profile(ip) for pod, ip in self.ips.items()}
        gates = {}
        for pod in self.ips:
            try:
                gates[pod] = fleet.gate_open(self.kube, self.namespace, pod)
            except Exception:  # the API server may be down: unknown is not open
                gates[pod] = False
        return Sample(at=at, expected=expected, served=served, gates=gates)

    def sampling(self) -> None:
        while not self._stop.is_set():
            found = self.sample()
            with self._lock:
                self.samples.append(found)
            self._stop.wait(SAMPLE_SECONDS)

    @property
    def latest(self) -> Sample | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    def converged_after(self, since: float, until: float | None = None) -> float | None:
        """The first time after `since` (and before `until`) when the fleet was right."""
        with self._lock:
            for found in self.samples:
                if found.at >= since and (until is None or found.at < until) and found.converged:
                    return found.at
        return None

    @contextlib.contextmanager
    def sampled(self) -> Iterator[None]:
        thread = threading.Thread(target=self.sampling, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join(timeout=10)


@dataclasses.dataclass(frozen=True)
class KindReport:
    kind: str
    count: int
    reconverge_seconds: list[float | None]
    failed_inside: int


@dataclasses.dataclass(frozen=True)
class Report:
    the_plan: Plan
    kinds: list[KindReport]
    requests: int
    failed_outside: int
    failed_inside: int
    switches: int
    wrong_at_end: list[str]
    outside_examples: list[str]
    seconds: float
    restarts: list[fleet.Restart] = dataclasses.field(default_factory=list)
    """The containers that restarted during the soak: a triton-kill's, and any other (a Triton
    that crashed in a reload: its previous run's last lines say why)."""


def faulted_spans(soak: Soak, end: float) -> list[tuple[faults.Fault, float, float]]:
    """Each Pod fault, and when it held its Pod: from injection until the fleet reconverged."""
    spans = []
    for fault in soak.faults:
        if fault.pod is not None:
            back = soak.converged_after(fault.healed or end) or end
            spans.append((fault, fault.injected - 0.5, back))
    return spans


def analyse(
    soak: Soak, loads: clients.PodLoads, switches: int, wrong: list[str], started: float
) -> Report:
    end = time.monotonic()
    spans = faulted_spans(soak, end)
    inside: dict[str, int] = {}
    outside = 0
    examples: list[str] = []
    for pod, records in loads.records.items():
        for record in records:
            if record.succeeded:
                continue
            sent = loads.origin + (record.sent if record.sent is not None else record.scheduled)
            done = sent + (record.latency or clients.REQUEST_TIMEOUT)
            holding = [
                fault
                for fault, start, stop in spans
                if fault.pod == pod and start <= done and sent <= stop
            ]
            if holding:
                inside[holding[-1].kind] = inside.get(holding[-1].kind, 0) + 1
            else:
                outside += 1
                if len(examples) < 5:
                    examples.append(f"{pod} at {sent - loads.origin:.1f} s: {record.error}")
    kinds = []
    for kind in dict.fromkeys(soak.the_plan.kinds):
        reconverge: list[float | None] = []
        for index, fault in enumerate(soak.faults):
            if fault.kind != kind:
                continue
            healed = fault.healed or fault.injected
            following = soak.faults[index + 1].injected if index + 1 < len(soak.faults) else None
            back = soak.converged_after(healed, following)
            reconverge.append(None if back is None else back - healed)
        kinds.append(
            KindReport(
                kind=kind,
                count=len(reconverge),
                reconverge_seconds=reconverge,
                failed_inside=inside.get(kind, 0),
            )
        )
    return Report(
        the_plan=soak.the_plan,
        kinds=kinds,
        requests=sum(len(records) for records in loads.records.values()),
        failed_outside=outside,
        failed_inside=sum(inside.values()),
        switches=switches,
        wrong_at_end=wrong,
        outside_examples=examples,
        seconds=end - started,
    )


def render(report: Report, *, markdown: bool) -> str:
    rows = []
    for kind in report.kinds:
        known = [value for value in kind.reconverge_seconds if value is not None]
        missed = len(kind.reconverge_seconds) - len(known)
        rows.append(
            [
                kind.kind,
                str(kind.count),
                benchmarking.cell(statistics.median(known) if known else None),
                benchmarking.cell(max(known) if known else None),
                str(missed),
                str(kind.failed_inside),
            ]
        )
    headers = [
        "fault",
        "injected",
        "reconverged p50 s",
        "worst s",
        "not before the next",
        "failed in the faulted Pod",
    ]
    table = (benchmarking.markdown_table if markdown else benchmarking.table)(headers, rows)
    plan_line = (
        f"{report.the_plan.replicas} replicas, {len(report.the_plan.kinds)} faults "
        f"{report.the_plan.gap_seconds:.0f} s apart over {report.seconds / 60:.1f} min"
    )
    totals = (
        f"faults injected: {sum(kind.count for kind in report.kinds)}; switches made: "
        f"{report.switches}; requests: {report.requests}; failed inside faulted Pods: "
        f"{report.failed_inside}; failed outside faulted Pods: {report.failed_outside}"
        + (f" ({'; '.join(report.outside_examples)})" if report.outside_examples else "")
        + f"; targets left wrong at the end: {len(report.wrong_at_end)}"
        + (f" ({', '.join(report.wrong_at_end)})" if report.wrong_at_end else "")
    )
    restarted = "; ".join(restart.describe() for restart in report.restarts) or "none"
    crashes = [
        f"{restart.pod}/{restart.container}'s previous run, its last lines:\n"
        + "\n".join(restart.previous_log.splitlines()[-CRASH_LOG_LINES:])
        for restart in report.restarts
        if restart.exit_code not in (None, 0, KILLED)
    ]
    crashed = "".join(f"\n\n{crash}" for crash in crashes)
    return f"{plan_line}\n\n{table}\n\n{totals}\n\ncontainers restarted: {restarted}{crashed}"


def summary_json(report: Report) -> dict[str, Any]:
    return {
        "plan": dataclasses.asdict(report.the_plan),
        "kinds": [dataclasses.asdict(kind) for kind in report.kinds],
        "requests": report.requests,
        "failed_inside": report.failed_inside,
        "failed_outside": report.failed_outside,
        "outside_examples": report.outside_examples,
        "switches": report.switches,
        "wrong_at_end": report.wrong_at_end,
        "seconds": report.seconds,
        "restarts": [dataclasses.asdict(restart) for restart in report.restarts],
    }


def switches_made(kube: Kube, namespace: str) -> int:
    listed = kube.core.list_namespaced_event(namespace).items
    return sum(event.count or 1 for event in listed if event.reason == "ProfileSwitched")


def run(
    kube: Kube, operator_kubeconfig: Path, client_host: podnetwork.Host, the_plan: Plan, out: Path
) -> Report:
    started = time.monotonic()
    assert kube.local is not None, "the soak needs the local cluster"
    chooser = random.Random(7)
    with benchmarking.namespace(kube, "bench-chaos") as namespace:
        ips = fleet.start_tritons(kube, namespace, the_plan.replicas, gated=True)
        found_windows = windows(datetime.datetime.now(datetime.UTC), the_plan.seconds / 60)
        soak = Soak(kube, operator_kubeconfig, namespace, ips, found_windows, the_plan, out)
        target = faults.Target(
            kube=kube,
            cluster=kube.local,
            namespace=namespace,
            ips=ips,
            restart_operator=soak.operator,
            edit_policy=soak.edit_policy,
        )
        soak.operator(False)
        try:
            soak.edit_policy(None)
            waiting.wait_for(
                "the fleet on its profile",
                lambda: soak.sample().converged,
                timeout=120,
                interval=1.0,
            )
            with clients.load_on_each(client_host, ips, rate=RATE) as loads, soak.sampled():
                origin = loads.origin
                for index, kind in enumerate(the_plan.kinds):
                    due = origin + index * the_plan.gap_seconds
                    time.sleep(max(due - time.monotonic(), 0.0))
                    pod = chooser.choice(sorted(ips)) if kind in faults.POD_KINDS else None
                    fault = faults.inject(kind, target, pod=pod, hold_seconds=the_plan.hold_seconds)
                    with soak._lock:
                        soak.faults.append(fault)
                    print(f"  {time.monotonic() - origin:6.1f} s  {fault.describe()}", flush=True)
                    if fault.heal_action is not None:
                        time.sleep(the_plan.hold_seconds)
                        fault.heal()
                last = time.monotonic()
                deadline = last + FINAL_WAIT_SECONDS
                while time.monotonic() < deadline and soak.converged_after(last) is None:
                    time.sleep(1)
                final = soak.latest
                wrong = final.wrong() if final is not None else sorted(ips)
            switches = switches_made(kube, namespace)
            restarts = fleet.container_restarts(kube, namespace, tail=PREVIOUS_LOG_LINES)
            benchmarking.delete_policies(kube, namespace)
        finally:
            for process in soak.operators:
                process.stop()
    return dataclasses.replace(analyse(soak, loads, switches, wrong, started), restarts=restarts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Chaos soak: load, schedule boundaries and random faults; is the fleet right?"
    )
    parser.add_argument("--short", action="store_true", help="2 faults, 2 replicas (CI)")
    parser.add_argument("--minutes", type=float, help="the soak's length (default 30)")
    parser.add_argument("--replicas", type=int, help="Triton Pods (default 3; --short: 2)")
    parser.add_argument("--seed", type=int, default=0, help="the order of the faults")
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    the_plan = plan(
        short=arguments.short,
        minutes=arguments.minutes,
        replicas=arguments.replicas,
        seed=arguments.seed,
    )
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos soak: {the_plan.replicas} replicas, {len(the_plan.kinds)} faults "
        f"{the_plan.gap_seconds:.0f} s apart ({', '.join(dict.fromkeys(the_plan.kinds))})",
        flush=True,
    )
    with (
        benchmarking.operator_cluster(out_dir, "chaos") as (kube, operator_kubeconfig),
        podnetwork.client_host(routes=controlplane.HOST_ROUTES) as client_host,
    ):
        report = run(kube, operator_kubeconfig, client_host, the_plan, out_dir)
    benchmarking.write_summary(
        out_dir,
        "summary-chaos",
        tables=functools.partial(render, report),
        data=summary_json(report),
    )
    if arguments.publish:
        benchmarking.publish(out_dir, ["summary-chaos.md"])
    print(f"\nwrote {out_dir}/summary-chaos.{{md,json}}; {report.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
