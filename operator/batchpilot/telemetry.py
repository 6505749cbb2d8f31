"""The Prometheus metrics batchpilot exports about itself: every name, in one place.

The standalone runner and the operator export the same families, so one dashboard and one set
of alerts serve both. Names are documented in the README's metrics table.

Every series is about one policy and names it by two labels, its namespace and its name, so
like-named policies of two namespaces never share a series. The series a policy exports are
remembered as they are written, so that they can leave with it: when its loop ends (deleted,
or handed to another replica), and, one by one, when its spec stops naming a profile or its
decisions stop reading a signal. A page of stale series would keep alerts firing, or silent,
about a policy nobody governs.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import canaries, rollouts
from batchpilot.policy import decisions
from batchpilot_triton import exposition

PREFIX = "batchpilot"

POLICY_NAMESPACE = "policy_namespace"
"""The label naming a policy's namespace. Not `namespace`: Prometheus' Kubernetes discovery gives
every scraped series that label (the namespace of the operator's own Pod), and a scrape would
rename ours to `exported_namespace`. The standalone runner takes it from its policy document's
metadata.namespace; without one it is empty, which Prometheus stores as no label."""
POLICY = "policy"
"""The label naming a policy (its metadata.name)."""

# The names as they appear on /metrics (counters with their `_total`), for the dashboard and the
# alert rules (`batchpilot_charts`) as much as for the collectors below.
ACTIVE_PROFILE = f"{PREFIX}_active_profile"
PROFILE_ROLE = f"{PREFIX}_profile_role"
PROFILE_SWITCHES = f"{PREFIX}_profile_switches_total"
DECISIONS = f"{PREFIX}_decisions_total"
APPLY_DURATION = f"{PREFIX}_apply_duration_seconds"
APPLY_ERRORS = f"{PREFIX}_apply_errors_total"
TARGETS = f"{PREFIX}_targets"
SIGNAL = f"{PREFIX}_signal"
SIGNALS_UNAVAILABLE = f"{PREFIX}_signals_unavailable"
SLO_P95_LATENCY = f"{PREFIX}_slo_p95_latency_seconds"
QUEUE_DELAY = f"{PREFIX}_queue_delay_microseconds"
NEXT_TRANSITION = f"{PREFIX}_next_transition_timestamp_seconds"
ROLLOUT_START = f"{PREFIX}_rollout_start_timestamp_seconds"
LEAD_TIME = f"{PREFIX}_lead_time_seconds"
GUARD_ACTIONS = f"{PREFIX}_slo_guard_actions_total"
DRAINS_INEFFECTIVE = f"{PREFIX}_drains_ineffective_total"
CANARY_VERDICTS = f"{PREFIX}_canary_verdicts_total"
CANARY_VERDICTS_BY = typing.get_args(canaries.VerdictLabel)
GUARD_ACTIONS_BY = typing.get_args(decisions.GuardAction)

APPLY_ERRORS_BY = typing.get_args(rollouts.ApplyError)
"""The reasons failed applies are counted by, the operator's and the runner's alike."""
TARGET_STATES: dict[str, rollouts.TargetState] = {
    "updated": "Updated",
    "pending": "Pending",
    "failed": "Failed",
    "unreachable": "Unreachable",
}
"""The `state` label of batchpilot_targets, for each state a replica can be in."""


@dataclass(frozen=True)
class PolicyLabels:
    """The labels that name a policy on each of its series."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


Family = TypeVar("Family", Counter, Gauge, Histogram)
AnyFamily = Counter | Gauge | Histogram


@dataclass(frozen=True)
class ControllerMetrics:
    """What a controller (runner or operator) reports per policy."""

    registry: CollectorRegistry
    active_profile: Gauge
    profile_role: Gauge
    switches: Counter
    decisions: Counter
    apply_seconds: Histogram
    apply_errors: Counter
    targets: Gauge
    signal: Gauge
    signals_unavailable: Gauge
    slo_p95: Gauge
    queue_delay: Gauge
    next_transition: Gauge
    rollout_start: Gauge
    lead_time: Gauge
    guard_actions: Counter
    drains_ineffective: Counter
    canary_verdicts: Counter
    exported: dict[PolicyLabels, set[tuple[AnyFamily, tuple[str, ...]]]] = field(
        default_factory=dict
    )
    """Per policy, the series written: each family with the labels after the policy's."""

    def series(self, family: Family, policy: PolicyLabels, *labels: str) -> Family:
        """The policy's series of `family` with the labels that follow the policy's, remembered
        so that it can be removed."""
        self.exported.setdefault(policy, set()).add((family, labels))
        return family.labels(policy.namespace, policy.name, *labels)

    def remove(self, family: AnyFamily, policy: PolicyLabels, *labels: str) -> None:
        """Stop exporting one of the policy's series (none if it was never written)."""
        self.exported.get(policy, set()).discard((family, labels))
        with contextlib.suppress(KeyError):  # never written
            family.remove(policy.namespace, policy.name, *labels)

    def forget(self, policy: PolicyLabels) -> None:
        """Stop exporting every series of the policy."""
        for family, labels in self.exported.pop(policy, set()):
            with contextlib.suppress(KeyError):
                family.remove(policy.namespace, policy.name, *labels)

    def keep_only(self, family: AnyFamily, policy: PolicyLabels, firsts: Collection[str]) -> None:
        """Remove the policy's series of `family` whose first own label (a profile, a signal's
        metric) is not among `firsts`."""
        for written, labels in list(self.exported.get(policy, ())):
            if written is family and labels and labels[0] not in firsts:
                self.remove(family, policy, *labels)


def controller_metrics(registry: CollectorRegistry | None = None) -> ControllerMetrics:
    registry = registry or CollectorRegistry()
    return ControllerMetrics(
        registry=registry,
        active_profile=Gauge(
            ACTIVE_PROFILE,
            "1 for the profile in force for a policy, 0 for its other profiles.",
            [POLICY_NAMESPACE, POLICY, "profile"],
            registry=registry,
        ),
        profile_role=Gauge(
            PROFILE_ROLE,
            "1 for each profile of a policy, labelled with its role (latency or throughput: "
            "spec.profiles.*.role, else the one its queue delay implies).",
            [POLICY_NAMESPACE, POLICY, "profile", "role"],
            registry=registry,
        ),
        switches=Counter(
            PROFILE_SWITCHES,
            "Profile switches decided, by the profile switched to.",
            [POLICY_NAMESPACE, POLICY, "profile"],
            registry=registry,
        ),
        decisions=Counter(
            DECISIONS,
            "Decisions made, by what chose the profile (override, load, schedule, default).",
            [POLICY_NAMESPACE, POLICY, "source"],
            registry=registry,
        ),
        apply_seconds=Histogram(
            APPLY_DURATION,
            "Time to apply a profile to one model on one server, reloads only.",
            [POLICY_NAMESPACE, POLICY],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        ),
        apply_errors=Counter(
            APPLY_ERRORS,
            "Failed applies, by reason: " + ", ".join(APPLY_ERRORS_BY) + ".",
            [POLICY_NAMESPACE, POLICY, "reason"],
            registry=registry,
        ),
        targets=Gauge(
            TARGETS,
            "Governed Triton servers by state (updated, pending, failed, unreachable).",
            [POLICY_NAMESPACE, POLICY, "state"],
            registry=registry,
        ),
        signal=Gauge(
            SIGNAL,
            "The load signals the last decision saw, by metric name.",
            [POLICY_NAMESPACE, POLICY, "metric"],
            registry=registry,
        ),
        signals_unavailable=Gauge(
            SIGNALS_UNAVAILABLE,
            "1 when the last decision lacked a load signal the policy needs (reading failed or "
            "the measurement is missing), else 0.",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        slo_p95=Gauge(
            SLO_P95_LATENCY,
            "The p95 latency objective of the profile in force (spec.slo); absent while the "
            "profile in force has none.",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        queue_delay=Gauge(
            QUEUE_DELAY,
            "max_queue_delay_microseconds of the settings in force (after SLO autotune).",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        next_transition=Gauge(
            NEXT_TRANSITION,
            "When the decision next changes by the clock (Unix time); 0 when none is due.",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        rollout_start=Gauge(
            ROLLOUT_START,
            "When the next scheduled change starts rolling out (Unix time): the lead time "
            "before the boundary for a change into a latency profile; 0 when none is due.",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        lead_time=Gauge(
            LEAD_TIME,
            "The lead time in force (schedule.leadTime, with auto resolved), in seconds.",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        drains_ineffective=Counter(
            DRAINS_INEFFECTIVE,
            "Drains in which a Pod kept receiving requests until rollout.drainTimeoutSeconds.",
            [POLICY_NAMESPACE, POLICY],
            registry=registry,
        ),
        canary_verdicts=Counter(
            CANARY_VERDICTS,
            "Canary verdicts on new settings (spec.rollout.canary), by verdict: "
            + ", ".join(CANARY_VERDICTS_BY)
            + ".",
            [POLICY_NAMESPACE, POLICY, "verdict"],
            registry=registry,
        ),
        guard_actions=Counter(
            GUARD_ACTIONS,
            "SLO guard changes of the queue delay: lowered on a p95 breach, restored after it.",
            [POLICY_NAMESPACE, POLICY, "action"],
            registry=registry,
        ),
    )


def count_from_zero(
    metrics: ControllerMetrics, policy: PolicyLabels, *, profiles: Iterable[str]
) -> None:
    """Export a policy's counters from zero: `increase()` cannot see the first increment of a
    series that appears at 1, so alerts would miss a first switch or a first failure."""
    for profile in profiles:
        metrics.series(metrics.switches, policy, profile)
    for reason in APPLY_ERRORS_BY:
        metrics.series(metrics.apply_errors, policy, reason)
    for action in GUARD_ACTIONS_BY:
        metrics.series(metrics.guard_actions, policy, action)
    metrics.series(metrics.drains_ineffective, policy)
    for verdict in CANARY_VERDICTS_BY:
        metrics.series(metrics.canary_verdicts, policy, verdict)


def record_decision(
    metrics: ControllerMetrics,
    policy: PolicyLabels,
    spec: specs.BatchPolicySpec,
    decision: decisions.Decision,
    *,
    signals: Mapping[str, float],
    signals_missing: bool,
    lead_seconds: float | None = None,
) -> None:
    """What a decision exports: the profile in force and why, its settings, what it saw. Series
    of profiles the spec no longer has, and of signals this decision did not see, leave."""
    for family in (metrics.active_profile, metrics.profile_role, metrics.switches):
        metrics.keep_only(family, policy, spec.profiles)
    metrics.keep_only(metrics.signal, policy, signals)
    count_from_zero(metrics, policy, profiles=spec.profiles)
    if decision.switched:
        metrics.series(metrics.switches, policy, decision.profile).inc()
    metrics.series(metrics.decisions, policy, decision.source).inc()
    for profile in spec.profiles:
        metrics.series(metrics.active_profile, policy, profile).set(profile == decision.profile)
    delay = decision.settings.dynamic_batching["max_queue_delay_microseconds"]
    metrics.series(metrics.queue_delay, policy).set(delay)
    upcoming = decision.next_transition
    metrics.series(metrics.next_transition, policy).set(upcoming.timestamp() if upcoming else 0)
    starts = decision.rollout_starts
    metrics.series(metrics.rollout_start, policy).set(starts.timestamp() if starts else 0)
    if lead_seconds is not None:
        metrics.series(metrics.lead_time, policy).set(lead_seconds)
    if decision.guard is not None:
        metrics.series(metrics.guard_actions, policy, decision.guard).inc()
    for metric, value in signals.items():
        metrics.series(metrics.signal, policy, metric).set(value)
    metrics.series(metrics.signals_unavailable, policy).set(signals_missing)
    set_objective(metrics, policy, spec, decision.profile)
    set_roles(metrics, policy, spec)


def record_canary(
    metrics: ControllerMetrics, policy: PolicyLabels, notes: Iterable[canaries.Note]
) -> None:
    """Each canary verdict of a pass, counted by what it was."""
    for note in notes:
        if note.verdict is not None:
            metrics.series(metrics.canary_verdicts, policy, note.verdict).inc()


def record_rollout(
    metrics: ControllerMetrics, policy: PolicyLabels, result: rollouts.Result
) -> None:
    """What a rollout exports: replicas by state, failures by reason, reload durations."""
    for label, state in TARGET_STATES.items():
        metrics.series(metrics.targets, policy, label).set(result.count(state))
    for outcome in result.outcomes:
        if outcome.error is not None:
            metrics.series(metrics.apply_errors, policy, outcome.error).inc()
        if outcome.drain is not None and outcome.drain.ineffective:
            metrics.series(metrics.drains_ineffective, policy).inc()
        for applied in outcome.applied:
            metrics.series(metrics.apply_seconds, policy).observe(applied.seconds)


def set_roles(
    metrics: ControllerMetrics, policy: PolicyLabels, spec: specs.BatchPolicySpec
) -> None:
    """Export each profile's role, so alerts can tell a throughput profile by more than its name."""
    for profile in spec.profiles:
        role = spec.profile_role(profile)
        for other in typing.get_args(specs.ProfileRole):
            if other != role:
                metrics.remove(metrics.profile_role, policy, profile, other)
        metrics.series(metrics.profile_role, policy, profile, role).set(1)


def set_objective(
    metrics: ControllerMetrics, policy: PolicyLabels, spec: specs.BatchPolicySpec, profile: str
) -> None:
    """Export the latency objective while it governs the profile in force, and only then."""
    objective = spec.slo.p95_latency_ms if spec.slo is not None else None
    if objective is not None and spec.slo_governs(profile):
        metrics.series(metrics.slo_p95, policy).set(objective / 1000)
    else:
        metrics.remove(metrics.slo_p95, policy)


async def serve(registry: CollectorRegistry, *, host: str, port: int) -> web.AppRunner:
    """Serve `/metrics` and `/healthz` until the returned runner is cleaned up."""
    app = web.Application()
    app.router.add_get("/metrics", exposition.metrics_handler(registry))
    app.router.add_get("/healthz", exposition.healthy)
    return await exposition.start(app, host=host, port=port)
