"""The Prometheus metrics batchpilot exports about itself: every name, in one place.

The standalone runner and the operator export the same families, so one dashboard and one set
of alerts serve both. Names are documented in the README's metrics table.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchpilot.applying import rollouts
from batchpilot.policy import decisions, specs
from batchpilot_triton import exposition

PREFIX = "batchpilot"

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


def controller_metrics(registry: CollectorRegistry | None = None) -> ControllerMetrics:
    registry = registry or CollectorRegistry()
    return ControllerMetrics(
        registry=registry,
        active_profile=Gauge(
            ACTIVE_PROFILE,
            "1 for the profile in force for a policy, 0 for its other profiles.",
            ["policy", "profile"],
            registry=registry,
        ),
        profile_role=Gauge(
            PROFILE_ROLE,
            "1 for each profile of a policy, labelled with its role (latency or throughput: "
            "spec.profiles.*.role, else the one its queue delay implies).",
            ["policy", "profile", "role"],
            registry=registry,
        ),
        switches=Counter(
            PROFILE_SWITCHES,
            "Profile switches decided, by the profile switched to.",
            ["policy", "profile"],
            registry=registry,
        ),
        decisions=Counter(
            DECISIONS,
            "Decisions made, by what chose the profile (override, load, schedule, default).",
            ["policy", "source"],
            registry=registry,
        ),
        apply_seconds=Histogram(
            APPLY_DURATION,
            "Time to apply a profile to one model on one server, reloads only.",
            ["policy"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        ),
        apply_errors=Counter(
            APPLY_ERRORS,
            "Failed applies, by reason: " + ", ".join(APPLY_ERRORS_BY) + ".",
            ["policy", "reason"],
            registry=registry,
        ),
        targets=Gauge(
            TARGETS,
            "Governed Triton servers by state (updated, pending, failed, unreachable).",
            ["policy", "state"],
            registry=registry,
        ),
        signal=Gauge(
            SIGNAL,
            "The load signals the last decision saw, by metric name.",
            ["policy", "metric"],
            registry=registry,
        ),
        signals_unavailable=Gauge(
            SIGNALS_UNAVAILABLE,
            "1 when the last decision lacked a load signal the policy needs (reading failed or "
            "the measurement is missing), else 0.",
            ["policy"],
            registry=registry,
        ),
        slo_p95=Gauge(
            SLO_P95_LATENCY,
            "The p95 latency objective of the profile in force (spec.slo); absent while the "
            "profile in force has none.",
            ["policy"],
            registry=registry,
        ),
        queue_delay=Gauge(
            QUEUE_DELAY,
            "max_queue_delay_microseconds of the settings in force (after SLO autotune).",
            ["policy"],
            registry=registry,
        ),
        next_transition=Gauge(
            NEXT_TRANSITION,
            "When the decision next changes by the clock (Unix time); 0 when none is due.",
            ["policy"],
            registry=registry,
        ),
        rollout_start=Gauge(
            ROLLOUT_START,
            "When the next scheduled change starts rolling out (Unix time): the lead time "
            "before the boundary for a change into a latency profile; 0 when none is due.",
            ["policy"],
            registry=registry,
        ),
        lead_time=Gauge(
            LEAD_TIME,
            "The lead time in force (schedule.leadTime, with auto resolved), in seconds.",
            ["policy"],
            registry=registry,
        ),
        drains_ineffective=Counter(
            DRAINS_INEFFECTIVE,
            "Drains in which a Pod kept receiving requests after it left its Services.",
            ["policy"],
            registry=registry,
        ),
        guard_actions=Counter(
            GUARD_ACTIONS,
            "SLO guard changes of the queue delay: lowered on a p95 breach, restored after it.",
            ["policy", "action"],
            registry=registry,
        ),
    )


def count_from_zero(metrics: ControllerMetrics, policy: str, *, profiles: Iterable[str]) -> None:
    """Export a policy's counters from zero: `increase()` cannot see the first increment of a
    series that appears at 1, so alerts would miss a first switch or a first failure."""
    for profile in profiles:
        metrics.switches.labels(policy, profile)
    for reason in APPLY_ERRORS_BY:
        metrics.apply_errors.labels(policy, reason)
    for action in GUARD_ACTIONS_BY:
        metrics.guard_actions.labels(policy, action)
    metrics.drains_ineffective.labels(policy)


def record_decision(
    metrics: ControllerMetrics,
    policy: str,
    spec: specs.BatchPolicySpec,
    decision: decisions.Decision,
    *,
    signals: Mapping[str, float],
    signals_missing: bool,
    lead_seconds: float | None = None,
) -> None:
    """What a decision exports: the profile in force and why, its settings, what it saw."""
    count_from_zero(metrics, policy, profiles=spec.profiles)
    if decision.switched:
        metrics.switches.labels(policy, decision.profile).inc()
    metrics.decisions.labels(policy, decision.source).inc()
    for profile in spec.profiles:
        metrics.active_profile.labels(policy, profile).set(profile == decision.profile)
    delay = decision.settings.dynamic_batching["max_queue_delay_microseconds"]
    metrics.queue_delay.labels(policy).set(delay)
    upcoming = decision.next_transition
    metrics.next_transition.labels(policy).set(upcoming.timestamp() if upcoming else 0)
    starts = decision.rollout_starts
    metrics.rollout_start.labels(policy).set(starts.timestamp() if starts else 0)
    if lead_seconds is not None:
        metrics.lead_time.labels(policy).set(lead_seconds)
    if decision.guard is not None:
        metrics.guard_actions.labels(policy, decision.guard).inc()
    for metric, value in signals.items():
        metrics.signal.labels(policy, metric).set(value)
    metrics.signals_unavailable.labels(policy).set(signals_missing)
    set_objective(metrics, policy, spec, decision.profile)
    set_roles(metrics, policy, spec)


def record_rollout(metrics: ControllerMetrics, policy: str, result: rollouts.Result) -> None:
    """What a rollout exports: replicas by state, failures by reason, reload durations."""
    for label, state in TARGET_STATES.items():
        metrics.targets.labels(policy, label).set(result.count(state))
    for outcome in result.outcomes:
        if outcome.error is not None:
            metrics.apply_errors.labels(policy, outcome.error).inc()
        if outcome.drain is not None and outcome.drain.ineffective:
            metrics.drains_ineffective.labels(policy).inc()
        for applied in outcome.applied:
            metrics.apply_seconds.labels(policy).observe(applied.seconds)


def set_roles(metrics: ControllerMetrics, policy: str, spec: specs.BatchPolicySpec) -> None:
    """Export each profile's role, so alerts can tell a throughput profile by more than its name."""
    for profile in spec.profiles:
        role = spec.profile_role(profile)
        for other in typing.get_args(specs.ProfileRole):
            if other != role:
                with contextlib.suppress(KeyError):  # never exported with that role
                    metrics.profile_role.remove(policy, profile, other)
        metrics.profile_role.labels(policy, profile, role).set(1)


def set_objective(
    metrics: ControllerMetrics, policy: str, spec: specs.BatchPolicySpec, profile: str
) -> None:
    """Export the latency objective while it governs the profile in force, and only then."""
    objective = spec.slo.p95_latency_ms if spec.slo is not None else None
    if objective is not None and spec.slo_governs(profile):
        metrics.slo_p95.labels(policy).set(objective / 1000)
    else:
        with contextlib.suppress(KeyError):  # not exported yet
            metrics.slo_p95.remove(policy)


async def serve(registry: CollectorRegistry, *, host: str, port: int) -> web.AppRunner:
    """Serve `/metrics` and `/healthz` until the returned runner is cleaned up."""
    app = web.Application()
    app.router.add_get("/metrics", exposition.metrics_handler(registry))
    app.router.add_get("/healthz", exposition.healthy)
    return await exposition.start(app, host=host, port=port)
