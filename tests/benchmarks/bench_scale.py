"""Operator scale: many BatchPolicies over real Triton Pods; CPU, memory, and a schedule boundary.

On the local Kubernetes cluster (`batchpilot_cluster`), R real tritonservers serve `gpu_sim` in R
Pods of its real node (containerd, the kubelet) spread over several namespaces, and one
`batchpilot operator` process governs them. For each policy count P it creates P BatchPolicies,
each selecting one Pod (round-robin over the Pods):

- the first R are live: each governs its own Pod's model and switches it for real;
- the other P - R govern the same model in `dryRun`, so several policies share each Pod. They
  go through every step of a reconcile up to the Triton boundary — list their Pods through the
  API, read the server's model index and its metrics page (every policy has a load rule, so its
  signals are read each tick), decide, write status and events — and stop before applying.

Every policy has the same schedule: `bulk` by default and an `interactive` window that opens at a
minute boundary a little ahead. Measured from the operator's /proc entries and its /metrics:

- steady state, before the boundary: CPU seconds per reconcile (reconciles counted by
  `batchpilot_decisions_total`), CPU per tick (all P policies once), the share of a core, RSS,
  and the requests the operator made of the API server per minute, by verb and resource (the
  local cluster's audit log keeps the operator's ServiceAccount's, `batchpilot_cluster.audit`);
- at the boundary: when the operator decided the switch for the first and the last policy (its
  log), when every live Pod's Triton served `interactive`, and when every policy's status said
  so, all relative to the boundary (negative: before it). With `schedule.leadTime: auto` (the
  default; `--lead-time 0s` for the old behaviour) the target is every live Pod serving the new
  profile at or before the boundary; at 0s the bound is one timer interval plus one replica wave
  (each live policy has one Pod), the wave being a reload measured alone first.

To reach `--targets` Pods selected by the policies (2,000 by default) beside the R live ones, it
creates Pods that never start: the same Triton Pod with a scheduling gate, so no node runs it and
it never gets an IP. The operator watches, indexes and selects them on every pass, as it would a
large fleet's, but no Triton stands behind them, so they add no reload and no Triton read: they
measure the watch, the index and selection at that size, not the apply path (no mock server may
stand in for Triton, and no traffic may go to an address the run did not make).

Beside them it can put `--other-pods` Pods that no policy governs in the same namespaces (the
rest of a shared cluster): the same Triton Pod, scheduling-gated so it never starts, without the
opt-in label `batchpilot.dev/governed`. The operator's watch selects Pods by that label on the
API server, so none of them should reach it; an operator that watches every Pod (`--baseline`
of a revision before the label) holds each. Each count is measured in turn, growing the same
cluster, every policy count and operator at each.

It also reports how much memory each real tritonserver took (MemAvailable before and after
starting them), and how many the machine's memory would hold.

The full mode reloads gpu_sim with one instance on each server first (`--instances`): each
instance is a Python backend process a reload restarts, and 32 servers restarting four each at
once on 2 cores took over a minute a reload.

    python tests/benchmarks/bench_scale.py             # 32 Tritons, 50, 200 and 500 policies
    python tests/benchmarks/bench_scale.py --short     # CI: 2 Tritons, 10 policies
    # the operator's memory with 0 and 20,000 ungoverned Pods, against main's:
    python tests/benchmarks/bench_scale.py --servers 2 --policies 200 \
        --other-pods 0 --other-pods 20000 --baseline main
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import benchmarking
import kubernetes.client
from prometheus_client.parser import text_string_to_metric_families

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators
from batchpilot.policy import rendering
from batchpilot_cluster import audit
from batchpilot_harness import demo_models, procfs
from batchpilot_testbed import fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import modelconfigs, servers

GROUP, VERSION, PLURAL = "batchpilot.dev", "v1alpha1", "batchpolicies"
INTERVAL = 5.0
"""The operator's timer (its default)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    servers: int
    namespaces: int
    policy_counts: tuple[int, ...]
    ahead_seconds: float
    """At least this long between creating the policies and the boundary: time for the first
    pass of every policy, which for the live ones is a rollout of bulk (on 2 cores, 32 reloads
    at once beside hundreds of dryRun policies' reads took over a minute)."""
    lead_time: str = "auto"
    """The policies' schedule.leadTime."""
    targets: int = 0
    """Pods the policies select, the live ones and scheduling-gated ones that never start."""
    instances: int | None = None
    """gpu_sim's instances on each server (None: its repository's 4). Each instance is a Python
    backend process that a reload restarts: on 2 cores, 32 servers reloading 4 each at once
    took 53-66 s a reload."""
    other_pods: tuple[int, ...] = (0,)
    """Counts of Pods no policy governs (without the opt-in label) to measure at, in turn."""


def plan(*, short: bool) -> Plan:
    if short:
        return Plan(
            servers=2,
            namespaces=1,
            policy_counts=(10,),
            ahead_seconds=30.0,
            targets=20,
            other_pods=(20,),
        )
    return Plan(
        servers=32,
        namespaces=4,
        policy_counts=(50, 200, 500),
        ahead_seconds=150.0,
        targets=2000,
        instances=1,
    )


# -- the operator process, seen from its /metrics ----------------------------------------------


def reconciles(page: str) -> float:
    """How many decisions the operator has made: one per policy reconcile."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        if family.name == "batchpilot_decisions"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float
    cpu: float
    rss: int
    reconciles: float

    @classmethod
    def of(cls, operator: operators.OperatorProcess) -> Sample:
        pid = operator.process.pid
        return cls(
            time.monotonic(),
            procfs.cpu_seconds(pid),
            procfs.resident_bytes(pid),
            reconciles(operator.metrics()),
        )


# -- the fleet --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Server:
    namespace: str
    pod: str
    ip: str


def start_servers(kube: Kube, namespaces: Sequence[str], count: int) -> list[Server]:
    names = [(namespaces[i % len(namespaces)], f"triton-{i}") for i in range(count)]
    placement = fleet.placement(kube)
    for namespace, pod in names:
        labels = {"app": "triton", "bench-pod": pod}
        kube.core.create_namespaced_pod(
            namespace, fleet.triton_pod(pod, placement=placement, labels=labels, gated=False)
        )

    def serving() -> list[Server] | None:
        found = []
        for namespace, pod in names:
            status = kube.core.read_namespaced_pod(pod, namespace).status
            ip = status.pod_ip if status else None
            if not ip or not status or status.phase != "Running" or not fleet.triton_ready(ip):
                return None
            found.append(Server(namespace=namespace, pod=pod, ip=ip))
        return found

    found: list[Server] = waiting.wait_for(
        f"{count} Triton pods serving", serving, timeout=60 + 10 * count, interval=1.0
    )
    return found


PENDING_GATE = "batchpilot.dev/bench-never-starts"


def create_pending_pods(kube: Kube, fleet_servers: Sequence[Server], count: int) -> None:
    """`count` Pods labelled like the live ones, round-robin, that no node ever runs: the
    scheduler leaves a Pod with a scheduling gate alone, so it stays Pending without an IP."""
    placement = fleet.placement(kube)

    def one(index: int) -> None:
        server = fleet_servers[index % len(fleet_servers)]
        pod = fleet.triton_pod(
            f"{server.pod}-pending-{index}",
            placement=placement,
            labels={"app": "triton-pending", "bench-pod": server.pod},
            gated=False,
        )
        assert pod.spec is not None
        pod.spec.scheduling_gates = [kubernetes.client.V1PodSchedulingGate(name=PENDING_GATE)]
        kube.core.create_namespaced_pod(server.namespace, pod)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, range(count)))


OTHER_APP = "bench-other"


def create_other_pods(
    kube: Kube, namespaces: Sequence[str], *, first: int, count: int, placement: fleet.Placement
) -> None:
    """`count` Pods (numbered from `first`, round-robin over the namespaces) that no policy
    selects and that do not opt in: the Triton Pod without the label, scheduling-gated so that
    no node runs it, as the rest of a shared cluster's Pods are to batchpilot."""

    def one(index: int) -> None:
        pod = fleet.triton_pod(
            f"other-{index}",
            placement=placement,
            labels={"app": OTHER_APP},
            gated=False,
            governed=False,
        )
        assert pod.spec is not None
        pod.spec.scheduling_gates = [kubernetes.client.V1PodSchedulingGate(name=PENDING_GATE)]
        kube.core.create_namespaced_pod(namespaces[index % len(namespaces)], pod)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, range(first, first + count)))


async def set_instances(fleet_servers: Sequence[Server], count: int) -> None:
    """Reloads gpu_sim on every server with `count` instances: the operator keeps whatever
    instance group a server runs (it rewrites dynamic_batching only)."""

    async def one(server: Server) -> None:
        async with servers.TritonServer(fleet.triton_url(server.ip)) as triton:
            config = await triton.model_config(demo_models.GPU_SIM)
            config["instance_group"] = [{"count": count, "kind": "KIND_CPU"}]
            await triton.load(demo_models.GPU_SIM, config)

    # A few at a time: every reload restarts the model's backend processes.
    for start in range(0, len(fleet_servers), 4):
        await asyncio.gather(*(one(server) for server in fleet_servers[start : start + 4]))


async def single_reload_seconds(server: Server) -> float:
    """One reload of one idle server, alone: the time a replica wave takes at best."""
    async with servers.TritonServer(fleet.triton_url(server.ip)) as triton:
        timings = []
        for name in ("interactive", "bulk"):
            settings = rendering.render(specs.Profile.model_validate(fleet.PROFILES[name]))
            applied = await actuators.apply_profile(
                triton, demo_models.GPU_SIM, settings, profile=f"probe-{name}"
            )
            timings.append(applied.seconds)
    return min(timings)


# -- one policy count -------------------------------------------------------------------------


def policy(
    name: str, pod: str, *, dry_run: bool, opens: datetime.datetime, lead_time: str
) -> dict[str, Any]:
    closes = opens + datetime.timedelta(minutes=30)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "BatchPolicy",
        "metadata": {"name": name, "labels": {"batchpilot.dev/bench": "scale"}},
        "spec": {
            "target": {
                "selector": {"matchLabels": {"bench-pod": pod}},
                "port": "http",
                "models": [fleet.MODEL],
            },
            "profiles": fleet.PROFILES,
            "defaultProfile": "bulk",
            "schedule": {
                "timezone": "UTC",
                "leadTime": lead_time,
                "windows": [
                    {
                        "profile": "interactive",
                        "start": opens.strftime("%H:%M"),
                        "end": closes.strftime("%H:%M"),
                    }
                ],
            },
            # Never holds; it makes every reconcile read the servers' metrics pages.
            "load": {"rules": [{"profile": "interactive", "metric": "requestRate", "above": 1e9}]},
            "minDwellSeconds": 0,
            "dryRun": dry_run,
        },
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SizeReport:
    policies: int
    other_pods: int
    """Pods in the served namespaces that no policy governs and that do not opt in."""
    settled: bool
    """Every policy reconciled (bulk) before the boundary; if not, the boundary was not
    measured, and the steady state is what the operator had reached by then."""
    code: str
    """Whose operator ran: "this checkout", or the baseline revision's short hash."""
    live: int
    dry_run: int
    create_seconds: float
    steady_seconds: float
    steady_reconciles: float
    steady_cpu_seconds: float
    rss_steady: int
    rss_peak: int
    targets_converged: float | None
    """Seconds from the boundary to every live Pod serving interactive."""
    statuses_converged: float | None
    decided: tuple[float, float] | None
    """Seconds from the boundary to the first and the last policy's switch (operator log)."""
    """Seconds from the boundary to every policy's status saying interactive."""
    served_after: tuple[float, ...]
    boundary_cpu_seconds: float
    boundary_reconciles: float
    warning_events: dict[str, int]
    """Warning events on the policies, by reason."""
    warning_examples: dict[str, str]
    log_errors: int
    api_requests: dict[str, int] | None
    """What the operator asked the API server in steady state, by verb and resource (the local
    cluster's audit log; None on a cluster without it)."""

    @property
    def cpu_per_reconcile(self) -> float | None:
        return benchmarking.ratio(self.steady_cpu_seconds, self.steady_reconciles)

    @property
    def cpu_per_tick(self) -> float | None:
        per = self.cpu_per_reconcile
        return None if per is None else per * self.policies

    @property
    def core_share(self) -> float | None:
        return benchmarking.ratio(self.steady_cpu_seconds, self.steady_seconds)

    @property
    def reconciles_per_second(self) -> float | None:
        return benchmarking.ratio(self.steady_reconciles, self.steady_seconds)

    @property
    def api_requests_per_minute(self) -> float | None:
        if self.api_requests is None:
            return None
        return benchmarking.ratio(60 * sum(self.api_requests.values()), self.steady_seconds)


def decisions_after(
    log: str, boundary: datetime.datetime, profile: str
) -> tuple[float, float] | None:
    """When the operator logged the policies' switches to `profile`, relative to the boundary:
    the operator's own part of the convergence, before any reload."""
    found = []
    for line in log.splitlines():
        if f": bulk -> {profile}:" not in line or not line.startswith("["):
            continue
        stamp = datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
        found.append(stamp.timestamp() - boundary.timestamp())  # the log's local time
    return (min(found), max(found)) if found else None


def warning_events(kube: Kube, namespaces: Sequence[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Warning events on the policies: how many by reason, and one message of each."""
    counted: dict[str, int] = {}
    examples: dict[str, str] = {}
    for namespace in namespaces:
        for event in kube.core.list_namespaced_event(namespace).items:
            if event.type == "Warning" and event.involved_object.kind == "BatchPolicy":
                reason = event.reason or "?"
                counted[reason] = counted.get(reason, 0) + (event.count or 1)
                examples.setdefault(reason, event.message or "")
    return counted, examples


def _create(kube: Kube, documents: Sequence[tuple[str, dict[str, Any]]]) -> None:
    api = kubernetes.client.CustomObjectsApi(kube.api_client)

    def one(item: tuple[str, dict[str, Any]]) -> None:
        namespace, body = item
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, documents))


def _statuses(kube: Kube, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    api = kubernetes.client.CustomObjectsApi(kube.api_client)
    found: list[dict[str, Any]] = []
    for namespace in namespaces:
        listed = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        found += listed["items"] if isinstance(listed, dict) else []
    return found


def _settled(items: Sequence[dict[str, Any]], count: int, profile: str) -> bool:
    return len(items) == count and all(
        (item.get("status") or {}).get("activeProfile") == profile
        and (item.get("status") or {}).get("observedGeneration")
        == item["metadata"].get("generation")
        for item in items
    )


def earliest_rollout_start(items: Sequence[dict[str, Any]]) -> datetime.datetime | None:
    starts = [
        datetime.datetime.fromisoformat(status["plannedRolloutStart"])
        for item in items
        if (status := item.get("status") or {}).get("plannedRolloutStart")
    ]
    return min(starts, default=None)


async def _serving_since(
    live: Sequence[Server], profile: str, boundary: float, within: float
) -> dict[str, float]:
    served: dict[str, float] = {}
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:

        async def check(server: Server) -> None:
            url = f"{fleet.triton_url(server.ip)}/v2/models/{fleet.MODEL}/config"
            try:
                async with session.get(url) as response:
                    config = await response.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return
            running = modelconfigs.applied_profile(config)
            delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
            if running == profile and delay == fleet.QUEUE_DELAY[profile]:
                served.setdefault(server.pod, time.monotonic() - boundary)

        while len(served) < len(live) and time.monotonic() < deadline:
            await asyncio.gather(*(check(s) for s in live if s.pod not in served))
            await asyncio.sleep(0.1)
    return served


def run_size(
    kube: Kube,
    operator_kubeconfig: Path,
    namespaces: Sequence[str],
    fleet_servers: Sequence[Server],
    count: int,
    the_plan: Plan,
    out_dir: Path,
    baseline: Baseline | None = None,
    other_pods: int = 0,
) -> SizeReport:
    # The boundary is read from this log: a previous run's lines would be decisions too.
    suffix = f"-{baseline.revision}" if baseline else ""
    log_path = out_dir / f"scale-operator-{count}-other{other_pods}{suffix}.log"
    log_path.unlink(missing_ok=True)
    operator = operators.OperatorProcess(
        kubeconfig=operator_kubeconfig,
        log_path=log_path,
        namespaces=list(namespaces),
        interval=INTERVAL,
        code=baseline.code if baseline else (),
        # 500 policies over 4 namespaces pass the default 100 a namespace; a baseline from
        # before the limit has no such option.
        extra=() if baseline else ("--max-policies-per-namespace", str(count)),
    )
    try:
        waiting.wait_for("the operator's liveness", operator.healthy, timeout=60)
        now = datetime.datetime.now(datetime.UTC)
        opens = (now + datetime.timedelta(seconds=the_plan.ahead_seconds)).replace(
            second=0, microsecond=0
        ) + datetime.timedelta(minutes=1)
        documents = []
        for index in range(count):
            server = fleet_servers[index % len(fleet_servers)]
            dry_run = index >= len(fleet_servers)
            name = f"policy-{index:03d}"
            documents.append(
                (
                    server.namespace,
                    policy(
                        name, server.pod, dry_run=dry_run, opens=opens, lead_time=the_plan.lead_time
                    ),
                )
            )
        created_at = time.monotonic()
        _create(kube, documents)
        create_seconds = time.monotonic() - created_at
        # An operator that cannot keep up (one watching every Pod of a crowded cluster) is
        # still measured: its memory is the point. The boundary is then not waited for.
        settle_by = time.monotonic() + max(
            (opens - datetime.datetime.now(datetime.UTC)).total_seconds() - 5, 5
        )
        settled = False
        while not settled and time.monotonic() < settle_by:
            settled = _settled(_statuses(kube, namespaces), count, "bulk")
            time.sleep(0 if settled else 1.0)
        before = Sample.of(operator)
        steady_from = datetime.datetime.now(datetime.UTC)
        until_boundary = (opens - datetime.datetime.now(datetime.UTC)).total_seconds()
        # Steady state ends a second before the boundary; the RSS peak is watched meanwhile.
        peak = before.rss
        while until_boundary > 1.0:
            time.sleep(min(1.0, until_boundary - 1.0))
            peak = max(peak, procfs.resident_bytes(operator.process.pid))
            until_boundary = (opens - datetime.datetime.now(datetime.UTC)).total_seconds()
        steady_end = Sample.of(operator)
        steady_until = datetime.datetime.now(datetime.UTC)
        boundary = time.monotonic() + until_boundary
        live = list(fleet_servers[: min(count, len(fleet_servers))])
        served = asyncio.run(
            _serving_since(live, "interactive", boundary, within=240.0 if settled else 0.0)
        )
        targets_converged = max(served.values()) if len(served) == len(live) else None
        statuses_converged = None
        deadline = time.monotonic() + (120 if settled else 0)
        while time.monotonic() < deadline:
            if _settled(_statuses(kube, namespaces), count, "interactive"):
                statuses_converged = time.monotonic() - boundary
                break
            peak = max(peak, procfs.resident_bytes(operator.process.pid))
            time.sleep(0.25)
        after = Sample.of(operator)
        warnings, examples = warning_events(kube, namespaces)
        for namespace in namespaces:
            benchmarking.delete_policies(kube, namespace)
    finally:
        operator.stop()
    log = operator.log
    return SizeReport(
        policies=count,
        settled=settled,
        other_pods=other_pods,
        code=baseline.revision if baseline else THIS_CHECKOUT,
        live=len(live),
        dry_run=count - len(live),
        create_seconds=create_seconds,
        steady_seconds=steady_end.at - before.at,
        steady_reconciles=steady_end.reconciles - before.reconciles,
        steady_cpu_seconds=steady_end.cpu - before.cpu,
        rss_steady=steady_end.rss,
        rss_peak=max(peak, after.rss),
        targets_converged=targets_converged,
        statuses_converged=statuses_converged,
        served_after=tuple(sorted(served.values())),
        boundary_cpu_seconds=after.cpu - steady_end.cpu,
        boundary_reconciles=after.reconciles - steady_end.reconciles,
        warning_events=warnings,
        warning_examples=examples,
        decided=decisions_after(log, opens, "interactive"),
        log_errors=sum("[ERROR" in line for line in log.splitlines()),
        api_requests=api_requests(kube, steady_from, steady_until),
    )


THIS_CHECKOUT = "this checkout"


@dataclasses.dataclass(frozen=True)
class Baseline:
    """Another revision's operator, run beside this checkout's on the same cluster and fleet."""

    revision: str
    code: tuple[Path, ...]


def extract_baseline(revision: str, out_dir: Path) -> Baseline:
    """The product's folders at `revision` (`git archive`), to shadow the installed ones."""
    root = Path(__file__).resolve().parents[2]
    short = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "--verify", f"{revision}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    folder = out_dir / f"baseline-{short}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", short, "operator", "sidecar"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return Baseline(short, (folder / "operator", folder / "sidecar"))


def api_requests(
    kube: Kube, since: datetime.datetime, until: datetime.datetime
) -> dict[str, int] | None:
    """The operator's requests to the API server in [since, until), from the audit log."""
    if kube.local is None:
        return None
    log = audit.log_path(kube.local.state_dir)
    return dict(audit.requests(log, user=operators.USER, since=since, until=until))


# -- reporting --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetFacts:
    servers: int
    namespaces: int
    start_seconds: float
    memory_per_server: float
    mem_available_before: int
    single_reload: float
    pending_pods: int = 0
    """Pods the policies select that never start (scheduling-gated)."""
    instances: int | None = None
    """gpu_sim's instances on each server (None: the repository's)."""

    @property
    def servers_memory_holds(self) -> int:
        """Servers that would fit in the memory that was available, keeping a fifth free."""
        return int(0.8 * self.mem_available_before / self.memory_per_server)


def render(
    facts: FleetFacts, sizes: Sequence[SizeReport], lead_time: str, *, markdown: bool
) -> str:
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    mib = 2**20
    # With a lead the target is the boundary itself; without, one interval plus one wave.
    bound = 0.0 if lead_time != "0s" else INTERVAL + facts.single_reload
    lines = [
        f"{facts.servers} real tritonservers (gpu_sim, {facts.instances or 4} "
        f"instance{'s' if facts.instances != 1 else ''} each) in Pods of the real "
        f"node in {facts.namespaces} namespace(s), started in {facts.start_seconds:.0f} s; "
        f"each took {facts.memory_per_server / mib:.0f} MiB (MemAvailable), so the "
        f"{facts.mem_available_before / 2**30:.1f} GiB available would hold about "
        f"{facts.servers_memory_holds} (keeping a fifth free); CPU is the tighter limit. "
        f"Operator timer {INTERVAL:g} s; one reload alone: {facts.single_reload:.2f} s; "
        f"schedule.leadTime {lead_time}. Times are relative to the boundary (negative: before).",
        "",
    ]
    if facts.pending_pods:
        lines[-1:-1] = [
            f"The policies select {facts.servers + facts.pending_pods:,} Pods: the "
            f"{facts.servers} live ones and {facts.pending_pods:,} that never start (a "
            "scheduling gate keeps them Pending, without an IP): the operator watches, indexes "
            "and selects them, but no Triton stands behind them, so they add no reload.",
        ]
    if any(size.other_pods for size in sizes):
        lines[-1:-1] = [
            "Other Pods: Pods in the same namespaces that no policy governs and that do not "
            "carry the opt-in label batchpilot.dev/governed (the same Triton Pod, "
            "scheduling-gated so that it never starts).",
        ]
    compared = any(size.code != THIS_CHECKOUT for size in sizes)
    others = any(size.other_pods for size in sizes)
    headers = [
        "policies (live + dryRun)",
        *(["other Pods"] if others else []),
        *(["operator"] if compared else []),
        "reconciles/s",
        "CPU ms/reconcile",
        "CPU s/tick",
        "core share",
        "RSS MiB (steady / peak)",
        "API requests/min",
        "boundary -> decided (s, first / last)",
        "boundary -> live Pods serve (s)",
        "boundary -> all statuses (s)",
        "target (s)",
        "warning events",
        "log errors",
    ]
    rows = []
    for size in sizes:
        per = size.cpu_per_reconcile
        rows.append(
            [
                f"{size.policies} ({size.live} + {size.dry_run})"
                + ("" if size.settled else ", not all reconciled"),
                *([f"{size.other_pods:,}"] if others else []),
                *([size.code] if compared else []),
                benchmarking.cell(size.reconciles_per_second),
                benchmarking.cell(None if per is None else 1000 * per),
                benchmarking.cell(size.cpu_per_tick, 2),
                benchmarking.cell(None if size.core_share is None else 100 * size.core_share, 0)
                + "%",
                f"{size.rss_steady / mib:.0f} / {size.rss_peak / mib:.0f}",
                benchmarking.cell(size.api_requests_per_minute, 0),
                "-" if size.decided is None else f"{size.decided[0]:.2f} / {size.decided[1]:.2f}",
                benchmarking.cell(size.targets_converged, 2),
                benchmarking.cell(size.statuses_converged, 2),
                f"{bound:.2f}",
                ", ".join(f"{n} {r}" for r, n in sorted(size.warning_events.items())) or "0",
                str(size.log_errors),
            ]
        )
    lines.append(tabulate(headers, rows))
    lines.append("")
    cores = os.cpu_count() or 1
    lines.append(
        f"- all {facts.servers} live servers reload at the same boundary on this machine's "
        f"{cores} cores; a reload mostly starts the model's {facts.instances or 4} Python "
        "backend process(es), CPU work, so "
        f"{facts.servers} reloads of {facts.single_reload:.2f} s take about "
        f"{facts.servers * facts.single_reload / cores:.1f} s however the operator schedules "
        "them (on a real cluster every replica reloads on its own node)"
    )
    for size in sizes:
        served = size.served_after
        met = size.targets_converged is not None and size.targets_converged <= bound
        spread = (
            f"first {served[0]:.2f} s, median {served[len(served) // 2]:.2f} s, last "
            f"{served[-1]:.2f} s"
            if served
            else "none"
        )
        whose = f" ({size.code}, {size.other_pods:,} other Pods)" if compared or others else ""
        if not size.settled:
            lines.append(
                f"- {size.policies} policies{whose}: NOT every policy was reconciled before the "
                "boundary (the operator did not keep up); the boundary was not measured, the "
                "steady figures are what it had reached by then"
            )
            continue
        lines.append(
            f"- {size.policies} policies{whose}: live Pods served interactive at {spread} after "
            "the "
            f"boundary; "
            + (
                "every live Pod serves the new profile at or before the boundary -> "
                if lead_time != "0s"
                else f"fleet converged within one interval plus one wave ({bound:.2f} s) -> "
            )
            + ("met" if met else "MISSED")
        )
        if size.api_requests is not None:
            per_minute = 60 / size.steady_seconds if size.steady_seconds > 0 else 0.0
            kinds = sorted(size.api_requests.items(), key=lambda item: -item[1])
            lines.append(
                f"  - API requests in steady state ({size.steady_seconds:.0f} s), per minute: "
                + (", ".join(f"{kind} {n * per_minute:.1f}" for kind, n in kinds) or "none")
            )
        for reason, message in sorted(size.warning_examples.items()):
            lines.append(f"  - {reason}, e.g.: {message[:300]}")
    return "\n".join(lines)


def summary_json(facts: FleetFacts, sizes: Sequence[SizeReport]) -> dict[str, Any]:
    return {
        "fleet": dataclasses.asdict(facts),
        "interval": INTERVAL,
        "sizes": [
            {
                **dataclasses.asdict(size),
                "cpu_per_reconcile": size.cpu_per_reconcile,
                "cpu_per_tick": size.cpu_per_tick,
            }
            for size in sizes
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Operator scale: many policies, real Tritons.")
    parser.add_argument("--short", action="store_true", help="2 Tritons, 10 policies")
    parser.add_argument("--servers", type=int, help="real Triton Pods (default 32; --short: 2)")
    parser.add_argument(
        "--lead-time", default="auto", help="the policies' schedule.leadTime (default auto)"
    )
    parser.add_argument(
        "--policies", type=int, action="append", help="a policy count to measure (repeatable)"
    )
    parser.add_argument(
        "--targets",
        type=int,
        help="Pods the policies select, live and never-starting (default 2000; --short: 20)",
    )
    parser.add_argument(
        "--instances",
        type=int,
        help="gpu_sim's instances on each server (default 1; --short: the repository's 4)",
    )
    parser.add_argument(
        "--other-pods",
        type=int,
        action="append",
        help="Pods no policy governs (without the opt-in label) in the same namespaces; each "
        "count is measured in turn (repeatable; default 0; --short: 20)",
    )
    parser.add_argument(
        "--ahead-seconds",
        type=float,
        help="at least this long from creating the policies to the boundary (default 150; "
        "--short: 30)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REVISION",
        help="also run that git revision's operator at each size, before this checkout's, on "
        "the same cluster and fleet (its operator/ and sidecar/ shadow the installed product)",
    )
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    the_plan = plan(short=arguments.short)
    the_plan = dataclasses.replace(the_plan, lead_time=arguments.lead_time)
    if arguments.servers:
        the_plan = dataclasses.replace(the_plan, servers=arguments.servers)
    if arguments.instances is not None:
        the_plan = dataclasses.replace(the_plan, instances=arguments.instances)
    if arguments.targets is not None:
        the_plan = dataclasses.replace(the_plan, targets=arguments.targets)
    if arguments.policies:
        the_plan = dataclasses.replace(the_plan, policy_counts=tuple(arguments.policies))
    if arguments.other_pods:
        the_plan = dataclasses.replace(the_plan, other_pods=tuple(sorted(arguments.other_pods)))
    if arguments.ahead_seconds is not None:
        the_plan = dataclasses.replace(the_plan, ahead_seconds=arguments.ahead_seconds)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline = extract_baseline(arguments.baseline, out_dir) if arguments.baseline else None
    started = time.monotonic()
    print(
        f"scale benchmark: {the_plan.servers} Tritons, {the_plan.targets} targets, "
        f"policies {the_plan.policy_counts}, other Pods {the_plan.other_pods}",
        flush=True,
    )
    sizes = []
    with (
        benchmarking.operator_cluster(out_dir, "scale") as (kube, operator_kubeconfig),
        contextlib.ExitStack() as stack,
    ):
        namespaces = [
            stack.enter_context(benchmarking.namespace(kube, f"bench-scale-{index}"))
            for index in range(the_plan.namespaces)
        ]
        available = mem_available_bytes()
        starting = time.monotonic()
        fleet_servers = start_servers(kube, namespaces, the_plan.servers)
        start_seconds = time.monotonic() - starting
        if the_plan.instances is not None:
            asyncio.run(set_instances(fleet_servers, the_plan.instances))
        pending = max(the_plan.targets - len(fleet_servers), 0)
        create_pending_pods(kube, fleet_servers, pending)
        time.sleep(3)
        facts = FleetFacts(
            servers=len(fleet_servers),
            namespaces=len(namespaces),
            start_seconds=start_seconds,
            memory_per_server=max(available - mem_available_bytes(), 1) / len(fleet_servers),
            mem_available_before=available,
            single_reload=asyncio.run(single_reload_seconds(fleet_servers[0])),
            pending_pods=pending,
            instances=the_plan.instances,
        )
        print(
            f"  {facts.servers} Tritons serving after {start_seconds:.0f} s, "
            f"{pending} Pods that never start beside them",
            flush=True,
        )
        others_made = 0
        for others in the_plan.other_pods:
            if others > others_made:
                making = time.monotonic()
                create_other_pods(
                    kube,
                    namespaces,
                    first=others_made,
                    count=others - others_made,
                    placement=fleet.placement(kube),
                )
                print(
                    f"  {others - others_made:,} other Pods created in "
                    f"{time.monotonic() - making:.0f} s ({others:,} in all)",
                    flush=True,
                )
                others_made = others
            for count in the_plan.policy_counts:
                for against in (baseline, None) if baseline else (None,):
                    size_started = time.monotonic()
                    sizes.append(
                        run_size(
                            kube,
                            operator_kubeconfig,
                            namespaces,
                            fleet_servers,
                            count,
                            the_plan,
                            out_dir,
                            against,
                            other_pods=others,
                        )
                    )
                    print(
                        f"  {count} policies, {others:,} other Pods ({sizes[-1].code}): done "
                        f"in {time.monotonic() - size_started:.0f} s, RSS steady "
                        f"{sizes[-1].rss_steady / 2**20:.0f} MiB",
                        flush=True,
                    )
    benchmarking.write_summary(
        out_dir,
        "summary-scale",
        tables=functools.partial(render, facts, sizes, the_plan.lead_time),
        data=summary_json(facts, sizes),
    )
    if arguments.publish:
        benchmarking.publish(out_dir, ["summary-scale.md"])
    print(f"\nwrote {out_dir}/summary-scale.{{md,json}}; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
