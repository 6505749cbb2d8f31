"""Canaries of new settings on the local cluster under load: which changes are promoted, which
rolled back, how soon, and how many requests met bad settings.

Real Triton + sidecar Pods (`batchpilot_testbed.fleet`) on the real node, each sent Poisson
arrivals of its own; `batchpilot operator` as its own process with `spec.rollout.canary`
(one canary replica, minRequests 100, p95 at most twice the others'). The policy's `bulk`
profile is edited in turn to:

- **good**: a 25 ms queue delay for 20 ms (promoted, then on every replica);
- **slow**: a 400 ms queue delay that batches of 32 never fill at this rate (every request
  waits it out);
- **failing**: a queue policy that rejects a request after 2 ms in the queue, under a 25 ms
  delay (most requests are rejected; Triton counts them as failed);
- **refusing**: a one-request queue (`maxQueueSize: 1`) under a 25 ms delay: about half the
  arrivals find it taken and get a 503 that Triton counts nowhere (the canary counts them by
  its share of the arrivals);
- **switch**: not an edit of the profile in force but a switch into a bulk the fleet never
  served (30 ms), from interactive (the fleet is moved there first, by an override, through a
  canary of its own): judged by bulk's own objectives, of which it has none, and its failures,
  never by its p95 against interactive's replicas; promoted.

While each change is on trial the canary Pod's served configuration is polled, so what met bad
settings is counted from the requests the canary Pod answered while it served them. The share
to compare it with is the canary's share of the replicas over the analysis window; nothing may
meet them after the verdict but the requests already queued when the rollback's reload began.

    python tests/benchmarks/bench_canary.py           # 4 Pods, a 60 s window, every change
    python tests/benchmarks/bench_canary.py --short   # CI: 2 Pods, a 15 s window, `failing`
    python tests/benchmarks/bench_canary.py --short --changes refusing,switch
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchmarking

from batchpilot_harness import loadgen
from batchpilot_testbed import clients, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube

RATE_PER_POD = 30.0
POLL_SECONDS = 0.1
FLEET_DELAY = 20_000
CHANGES: dict[str, dict[str, Any]] = {
    "good": {"maxQueueDelayMicroseconds": 25_000, "preferredBatchSizes": [32, 64]},
    "slow": {"maxQueueDelayMicroseconds": 400_000, "preferredBatchSizes": [32, 64]},
    "failing": {
        "maxQueueDelayMicroseconds": 25_000,
        "preferredBatchSizes": [32, 64],
        "queuePolicy": {"timeoutAction": "REJECT", "defaultTimeoutMicroseconds": 2000},
    },
    "refusing": {
        "maxQueueDelayMicroseconds": 25_000,
        "preferredBatchSizes": [32, 64],
        "queuePolicy": {"maxQueueSize": 1},
    },
    "switch": {"maxQueueDelayMicroseconds": 30_000, "preferredBatchSizes": [32, 64]},
}
EXPECTED = {
    "good": "Promoted",
    "slow": "RolledBack",
    "failing": "RolledBack",
    "refusing": "RolledBack",
    "switch": "Promoted",
}
SWITCHES = frozenset({"switch"})
"""Changes that switch into bulk from interactive rather than edit bulk while in force."""


@dataclasses.dataclass(frozen=True)
class Plan:
    pods: int
    analysis_seconds: int
    changes: tuple[str, ...]


def plan(*, short: bool, changes: Sequence[str] = ()) -> Plan:
    if short:
        return Plan(pods=2, analysis_seconds=15, changes=tuple(changes) or ("failing",))
    return Plan(pods=4, analysis_seconds=60, changes=tuple(changes) or tuple(CHANGES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trial:
    change: str
    verdict: str
    reason: str
    figures: str
    to_verdict: float
    """Seconds from the spec edit to the verdict in the status."""
    canary_pod: str
    edited_at: float
    verdict_at: float
    ended_at: float
    """The edit, the verdict and the trial's end, on the load's clock."""
    on_trial: tuple[float, float] | None
    """When the canary Pod served the change's settings (seconds on the load's clock)."""
    met: int
    """Requests the canary Pod answered while it served the change's settings."""
    met_after_verdict: int
    all_requests: int
    """Requests to every Pod while the canary Pod served the settings."""
    canary_share: float
    failed_on_canary: int
    failed_elsewhere: int
    """Failed requests to the other Pods, from the edit to the end of the trial."""

    @property
    def share_met(self) -> float | None:
        return benchmarking.ratio(self.met, self.all_requests)


class ConfigWatch:
    """When one Pod served a queue delay and queue policy, polled in a thread."""

    def __init__(self, ip: str, load: clients.PodArrivals) -> None:
        self.ip = ip
        self.load = load
        self.seen: list[tuple[float, dict[str, Any]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            config = fleet.served_config(self.ip) or {}
            self.seen.append((self.load.now(), dict(config.get("dynamic_batching") or {})))
            self.stop.wait(POLL_SECONDS)

    def served(self, settings: dict[str, Any]) -> tuple[float, float] | None:
        """The first stretch in which the Pod served `settings`' delay and queue policy."""
        wanted_delay = settings["maxQueueDelayMicroseconds"]
        wanted_queue = settings.get("queuePolicy", {})
        start = end = None
        for at, batching in self.seen:
            delay = int(batching.get("max_queue_delay_microseconds", -1))
            queue = batching.get("default_queue_policy") or {}
            matches = (
                delay == wanted_delay
                and int(queue.get("default_timeout_microseconds") or 0)
                == wanted_queue.get("defaultTimeoutMicroseconds", 0)
                and int(queue.get("max_queue_size") or 0) == wanted_queue.get("maxQueueSize", 0)
            )
            if matches and start is None:
                start = at
            if start is not None:
                end = at
                if not matches:
                    break
        return None if start is None or end is None else (start, end)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def policy(analysis_seconds: int) -> dict[str, Any]:
    return fleet.policy(
        rollout={
            "maxUnavailable": 1,
            "canary": {
                "replicas": 1,
                "analysisSeconds": analysis_seconds,
                "minRequests": 100,
                "maxP95Ratio": 2,
            },
        }
    )


def with_bulk(document: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    edited = copy.deepcopy(document)
    edited["spec"]["profiles"]["bulk"] = dict(settings)
    return edited


def run_trial(
    kube: Kube,
    namespace: str,
    ips: dict[str, str],
    load: clients.PodArrivals,
    document: dict[str, Any],
    change: str,
    the_plan: Plan,
) -> Trial:
    settings = CHANGES[change]
    if change in SWITCHES:
        on_interactive = copy.deepcopy(document)
        on_interactive["spec"]["override"] = {"profile": "interactive"}
        operators.apply_policy(kube, namespace, on_interactive)
        waiting.wait_for(
            "interactive everywhere",
            fleet.everyone_serves(ips, "interactive"),
            timeout=the_plan.analysis_seconds + 90,
        )
    before = operators.canary_status(kube, namespace, "fleet").get("settingsHash")
    edited_at = load.now()
    edited_clock = time.monotonic()
    operators.apply_policy(kube, namespace, with_bulk(document, settings))

    def decided() -> dict[str, Any] | None:
        canary = operators.canary_status(kube, namespace, "fleet")
        fresh = canary.get("settingsHash") not in (None, before)
        done = canary.get("phase") in ("Promoted", "RolledBack", "Inconclusive")
        return canary if fresh and done else None

    watches = {name: ConfigWatch(ip, load) for name, ip in ips.items()}
    try:
        verdict = waiting.wait_for(
            f"the verdict on {change}", decided, timeout=the_plan.analysis_seconds + 120
        )
        to_verdict = time.monotonic() - edited_clock
        verdict_at = load.now()
        canary_pod = verdict["replicas"][0]
        if verdict["phase"] == "Promoted":
            waiting.wait_for(
                f"{change} everywhere",
                lambda: all(
                    fleet.queue_delay(ip) == settings["maxQueueDelayMicroseconds"]
                    for ip in ips.values()
                ),
                timeout=60,
            )
        else:
            time.sleep(3)  # the rollback's reload, watched
    finally:
        for watch in watches.values():
            watch.close()
    ended_at = load.now()
    on_trial = watches[canary_pod].served(settings)
    records = load.records()
    canary_url = fleet.triton_url(ips[canary_pod])
    met = met_after = everyone = 0
    if on_trial is not None:
        start, end = on_trial
        inside = benchmarking.between(records, start, end)
        everyone = len(inside)
        met = sum(r.server == canary_url for r in inside)
        met_after = sum(r.server == canary_url and r.scheduled >= verdict_at for r in inside)
    trial_records = benchmarking.between(records, edited_at, ended_at)
    return Trial(
        change=change,
        verdict=verdict["phase"],
        reason=verdict.get("reason", ""),
        figures=verdict.get("figures", ""),
        to_verdict=to_verdict,
        canary_pod=canary_pod,
        edited_at=edited_at,
        verdict_at=verdict_at,
        ended_at=ended_at,
        on_trial=on_trial,
        met=met,
        met_after_verdict=met_after,
        all_requests=everyone,
        canary_share=1 / len(ips),
        failed_on_canary=sum(not r.succeeded for r in trial_records if r.server == canary_url),
        failed_elsewhere=sum(not r.succeeded for r in trial_records if r.server != canary_url),
    )


def render(trials: Sequence[Trial], the_plan: Plan, *, markdown: bool) -> str:
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    headers = [
        "change",
        "verdict (expected)",
        "edit -> verdict (s)",
        "requests that met the settings",
        "of all requests meanwhile",
        "canary's share of replicas",
        "met after the verdict",
        "failed on the canary",
        "failed elsewhere",
    ]
    rows = [
        [
            trial.change,
            f"{trial.verdict} ({EXPECTED[trial.change]})",
            f"{trial.to_verdict:.1f}",
            str(trial.met),
            "-" if trial.share_met is None else f"{100 * trial.share_met:.1f}%",
            f"{100 * trial.canary_share:.0f}%",
            str(trial.met_after_verdict),
            str(trial.failed_on_canary),
            str(trial.failed_elsewhere),
        ]
        for trial in trials
    ]
    lines = [
        f"{the_plan.pods} Triton Pods on the real node, {RATE_PER_POD:g} req/s each; canary: 1 "
        f"replica, a {the_plan.analysis_seconds} s window, minRequests 100, p95 at most 2x the "
        "others'.",
        "",
        tabulate(headers, rows),
        "",
    ]
    lines += [f"- {t.change}: {t.verdict}: {t.reason} ({t.figures})" for t in trials]
    return "\n".join(lines)


def plot(
    path: Path,
    trials: Sequence[Trial],
    records: Sequence[loadgen.RequestRecord],
    ips: dict[str, str],
) -> None:
    """Per trial, the canary Pod's p95 against the other Pods', second by second; the edit and
    the verdict marked, windows with failed requests crossed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not trials:
        return
    figure, axes = plt.subplots(len(trials), 1, figsize=(10, 2.6 * len(trials)), squeeze=False)
    for axis, trial in zip(axes[:, 0], trials, strict=True):
        canary_url = fleet.triton_url(ips[trial.canary_pod])
        start, end = trial.edited_at - 5, trial.ended_at
        for label, chosen in (
            (f"canary ({trial.canary_pod})", [r for r in records if r.server == canary_url]),
            ("the other Pods", [r for r in records if r.server != canary_url]),
        ):
            found = benchmarking.windows(chosen, start=start, end=end, width=1.0)
            middles = [(w.start + w.end) / 2 - trial.edited_at for w in found]
            values = [w.p95_ms if w.p95_ms is not None else float("nan") for w in found]
            axis.plot(middles, values, linewidth=1.2, label=label)
            crossed = [(m, v) for m, v, w in zip(middles, values, found, strict=True) if w.failed]
            if crossed:
                axis.scatter(*zip(*crossed, strict=True), color="red", marker="x", zorder=3)
        for offset, text in ((0.0, "edit"), (trial.verdict_at - trial.edited_at, trial.verdict)):
            axis.axvline(offset, color="grey", linewidth=0.8, linestyle=":")
            axis.text(offset, 1.0, f" {text}", transform=axis.get_xaxis_transform(),
                      fontsize=7, va="top")  # fmt: skip
        axis.set_yscale("log")
        axis.set_ylabel("p95 (ms)")
        axis.set_title(f"{trial.change}: {trial.verdict}", fontsize=9, loc="left")
        axis.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds after the spec edit (x: a second with failed requests)")
    figure.suptitle("canary against the other replicas", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Canaries of new settings under load.")
    parser.add_argument("--short", action="store_true", help="2 Pods, 15 s window, one change")
    parser.add_argument(
        "--changes",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        help=f"comma-separated, of {', '.join(CHANGES)} (default: the plan's)",
    )
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    unknown = [name for name in arguments.changes if name not in CHANGES]
    if unknown:
        parser.error(f"unknown changes: {', '.join(unknown)}")
    the_plan = plan(short=arguments.short, changes=arguments.changes)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    trials: list[Trial] = []
    with (
        benchmarking.operator_cluster(out_dir, "canary") as (kube, operator_kubeconfig),
        benchmarking.namespace(kube, "bench-canary") as namespace,
    ):
        ips = fleet.start_tritons(kube, namespace, the_plan.pods)
        operator = operators.OperatorProcess(
            kubeconfig=operator_kubeconfig,
            log_path=out_dir / "canary-operator.log",
            namespaces=[namespace],
            interval=1.0,
        )
        try:
            document = policy(the_plan.analysis_seconds)
            operators.apply_policy(kube, namespace, document)
            waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=90)
            switches = sum(change in SWITCHES for change in the_plan.changes)
            budget = (len(the_plan.changes) + switches) * (the_plan.analysis_seconds + 60) + 30
            load = clients.PodArrivals(ips, rate=RATE_PER_POD, seconds=budget)
            time.sleep(6)  # the sidecars' rate windows fill
            for change in the_plan.changes:
                trials.append(run_trial(kube, namespace, ips, load, document, change, the_plan))
                print(f"  {change}: {trials[-1].verdict} in {trials[-1].to_verdict:.1f} s")
            load.stop()
            benchmarking.delete_policies(kube, namespace)
        finally:
            operator.stop()
        plot(out_dir / "canary.png", trials, load.records(), ips)
    benchmarking.write_summary(
        out_dir,
        "summary-canary",
        tables=functools.partial(render, trials, the_plan),
        data={
            "plan": dataclasses.asdict(the_plan),
            "trials": [dataclasses.asdict(t) for t in trials],
        },
    )
    if arguments.publish:
        benchmarking.publish(out_dir, ["summary-canary.md", "canary.png"])
    print(f"\nwrote {out_dir}/summary-canary.{{md,json}}; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
