"""What a reconcile reports: the policy's status and its events, from what it found. Pure.

The reconcile gathers its findings (observed, decided, done) into `Findings`; everything people
read comes from them here, one function per part: each target's detail, each condition, each
event. The previous status comes in typed, parsed once, so what did not change keeps its times
and a steady fleet gets a status equal to the last one, which is then not written again.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from batchpilot.api import durations, names
from batchpilot.api.v1alpha1 import specs, statuses
from batchpilot.applying import canaries, rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import decisions, leads

MAX_TARGET_DETAILS = 64


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Notice:
    """An event to post, or a standing problem: one with a `key` is posted when it begins or its
    message changes, and forgotten (`event` None) once it is over, so it is reported once."""

    event: Event | None
    key: str | None = None


@dataclass(frozen=True, kw_only=True)
class Findings:
    """Everything one reconcile of a policy found."""

    now: datetime.datetime
    """When it ran, in whole seconds (status times are whole seconds)."""
    generation: int | None
    problems: tuple[str, ...] = ()
    """Why the spec cannot be applied (the InvalidSpec condition); nothing was changed."""
    policy: specs.BatchPolicySpec | None = None
    """None when the spec did not parse."""
    decision: decisions.Decision | None = None
    previous_profile: str | None = None
    """The profile decided by the reconcile before this one."""
    replicas: Sequence[Replica] = ()
    skipped: Sequence[str] = ()
    """Pods the selector matched that cannot be replicas, and why."""
    contested: Sequence[str] = ()
    """Pods the selector matched that an older policy governs (`batchpilot.policy.governing`)."""
    limited: Sequence[str] = ()
    """What the operator's limits (`reconciling.Limits`) kept this policy from governing."""
    not_injected: Sequence[str] = ()
    """Pods it selects that opted into the admission webhook and were created without its
    injection (`kube.pods`): batchpilot cannot switch them."""
    result: rollouts.Result | None = None
    """What the rollout did (or, in a dry run, would have left alone)."""
    signal_problems: tuple[str, ...] = ()
    """Why load signals the policy needs are missing."""
    lead: leads.Lead | None = None
    measured_wave_seconds: float | None = None
    credential_problem: str | None = None
    """Why the policy's repository credential cannot be had; nothing was applied."""
    canary: statuses.CanaryStatus | None = None
    """The latest canary (`batchpilot.applying.canaries`)."""
    settings_history: statuses.SettingsHistory | None = None
    canary_notes: Sequence[canaries.Note] = ()
    """What this pass did with the canary: its events."""
    canary_failure: statuses.FailedSettings | None = None
    """The decided settings' failed canary, when they failed one under this spec."""


def previous_status(status: Mapping[str, Any]) -> statuses.BatchPolicyStatus:
    """The status as last written; one this version cannot read counts as none."""
    try:
        return statuses.BatchPolicyStatus.model_validate(status)
    except pydantic.ValidationError:
        return statuses.BatchPolicyStatus()


def missing_signals(policy: specs.BatchPolicySpec, measured: Mapping[str, float]) -> list[str]:
    rules = policy.load.rules if policy.load else []
    return [
        f"no {metric} measurement" for metric in sorted({r.metric for r in rules} - {*measured})
    ]


# The status ------------------------------------------------------------------------------------


def status(findings: Findings, previous: statuses.BatchPolicyStatus) -> dict[str, Any]:
    """The status to write, as the API takes it."""
    written = _invalid(findings, previous) if findings.problems else _decided(findings, previous)
    found = document(written)
    # A merge patch keeps fields it does not mention; clear what no longer applies.
    found.setdefault("nextTransitionTime", None)
    return found


def rolling_out(
    findings: Findings, previous: statuses.BatchPolicyStatus
) -> statuses.BatchPolicyStatus:
    """The status while a rollout to a newly decided profile runs, written before it starts:
    a rollout can take minutes (a load may take up to its timeout on each replica), and a new
    policy would show nothing until then. activeProfile, its reason, the targets and the other
    conditions stay as they were; the pass's own status replaces this one when the rollout
    ends."""
    decision, policy = findings.decision, findings.policy
    assert decision is not None, "a valid spec is decided"
    assert policy is not None
    count = len(findings.replicas)
    at_a_time = min(policy.rollout.max_unavailable, count)
    wanted = {
        "Progressing": (
            True,
            "RollingOut",
            f"rolling out {decision.profile} to {count} targets, {at_a_time} at a time",
        )
    }
    if not any(condition.type == "Ready" for condition in previous.conditions):
        wanted["Ready"] = (False, "RollingOut", f"the first rollout, of {decision.profile}, runs")
    changed = {condition.type: condition for condition in conditions(wanted, findings, previous)}
    kept = [changed.pop(condition.type, condition) for condition in previous.conditions]
    return previous.model_copy(
        update={
            "desired_profile": decision.desired_profile,
            "conditions": [*kept, *changed.values()],
            "observed_generation": findings.generation,
        }
    )


def document(written: statuses.BatchPolicyStatus) -> dict[str, Any]:
    """A status as the API takes it."""
    return written.model_dump(by_alias=True, mode="json", exclude_none=True)


def _invalid(
    findings: Findings, previous: statuses.BatchPolicyStatus
) -> statuses.BatchPolicyStatus:
    message = "; ".join(findings.problems)
    wanted = {
        "Ready": (False, "InvalidSpec", "the spec cannot be applied; nothing was changed"),
        "InvalidSpec": (True, "InvalidSpec", message),
        "Progressing": (False, "InvalidSpec", ""),
        "Degraded": (False, "InvalidSpec", ""),
        "SignalsUnavailable": (False, "InvalidSpec", ""),
        "LeadTimeInsufficient": (False, "InvalidSpec", ""),
        "DrainIneffective": (False, "InvalidSpec", ""),
        "PodsContested": (False, "InvalidSpec", ""),
        "PodsNotInjected": (False, "InvalidSpec", ""),
        "LimitExceeded": (False, "InvalidSpec", ""),
        "CredentialRefused": (False, "InvalidSpec", ""),
        "CanaryFailed": (False, "InvalidSpec", ""),
    }
    decision = findings.decision
    return previous.model_copy(
        update={
            "reason": f"invalid spec: {message}"[:1024],
            "desired_profile": decision.desired_profile if decision else previous.desired_profile,
            "conditions": conditions(wanted, findings, previous),
            "observed_generation": findings.generation,
        }
    )


def _decided(
    findings: Findings, previous: statuses.BatchPolicyStatus
) -> statuses.BatchPolicyStatus:
    decision, policy = findings.decision, findings.policy
    assert decision is not None, "a valid spec is decided"
    assert policy is not None
    details = target_details(findings, previous)
    counts = target_counts(details, dry_run=policy.dry_run)
    wanted = {
        "Ready": ready(findings, counts),
        "Progressing": progressing(decision, details),
        "Degraded": degraded(details),
        "InvalidSpec": (False, "Valid", ""),
        "SignalsUnavailable": signals_unavailable(findings.signal_problems),
        "LeadTimeInsufficient": lead_time_insufficient(policy, findings.lead),
        "DrainIneffective": drain_ineffective(findings.result, previous),
        "PodsContested": pods_contested(findings.contested),
        "PodsNotInjected": pods_not_injected(findings.not_injected),
        "LimitExceeded": limit_exceeded(findings.limited),
        "CredentialRefused": credential_refused(findings),
        "CanaryFailed": canary_failed(findings.canary_failure),
    }
    return statuses.BatchPolicyStatus(
        active_profile=decision.profile,
        desired_profile=decision.desired_profile,
        reason=decision.reason[:1024],
        last_transition_time=(
            findings.now
            if previous.active_profile != decision.profile
            else previous.last_transition_time or decision.memory.since
        ),
        next_transition_time=decision.next_transition,
        planned_rollout_start=decision.rollout_starts,
        lead_time_seconds=findings.lead.lead.total_seconds() if findings.lead else None,
        measured_wave_seconds=(
            round(findings.measured_wave_seconds, 3)
            if findings.measured_wave_seconds is not None
            else None
        ),
        targets=counts,
        target_details=details[:MAX_TARGET_DETAILS],
        conditions=conditions(wanted, findings, previous),
        settings=findings.settings_history,
        canary=findings.canary,
        observed_generation=findings.generation,
    )


def target_details(
    findings: Findings, previous: statuses.BatchPolicyStatus
) -> list[statuses.TargetStatus]:
    """One detail per replica; an unchanged detail keeps its time, so the status stays still."""
    earlier = {detail.name: detail for detail in previous.target_details}
    outcomes = {o.replica.name: o for o in findings.result.outcomes} if findings.result else {}
    details = []
    for replica in findings.replicas:
        outcome = outcomes.get(replica.name)
        state = outcome.state if outcome else "Pending"
        message = (outcome.message if outcome else "not rolled out")[:1024]
        before = earlier.get(replica.name)
        unchanged = before is not None and (before.state, before.message) == (state, message)
        details.append(
            statuses.TargetStatus(
                name=replica.name,
                endpoint=replica.endpoint,
                profile=outcome.profile if outcome else None,
                state=state,
                message=message,
                last_update_time=(before.last_update_time if unchanged and before else None)
                or findings.now,
            )
        )
    return details


def target_counts(
    details: Sequence[statuses.TargetStatus], *, dry_run: bool
) -> statuses.TargetCounts:
    total = len(details)
    updated = sum(detail.state == "Updated" for detail in details)
    failed = sum(detail.state in ("Failed", "Unreachable") for detail in details)
    summary = f"{updated}/{total} updated" + (f", {failed} failed" if failed else "")
    if dry_run:
        summary = f"dry run, {total} targets"
    return statuses.TargetCounts(total=total, updated=updated, failed=failed, summary=summary)


Wanted = tuple[bool, str, str]
"""A condition as a reconcile finds it: whether it holds, its reason and its message."""


def ready(findings: Findings, counts: statuses.TargetCounts) -> Wanted:
    decision, policy = findings.decision, findings.policy
    assert decision is not None, "a valid spec is decided"
    assert policy is not None
    if policy.dry_run:
        return False, "DryRun", "decisions are reported, nothing is applied"
    if findings.credential_problem is not None:
        return False, "CredentialUnavailable", findings.credential_problem
    if counts.total == 0 and findings.contested:
        return False, "NoTargets", "every Pod it selects is governed by an older policy"
    if counts.total == 0:
        message = (
            f"no Running Pod with an IP and the label {names.GOVERNED_SELECTOR} matches "
            "spec.target.selector"
        )
        if findings.skipped:
            message += f" ({'; '.join(findings.skipped)})"
        return False, "NoTargets", message
    if findings.canary_failure is not None:
        return False, "CanaryFailed", canary_failed(findings.canary_failure)[2]
    if counts.updated == counts.total:
        return True, "RolledOut", f"{decision.profile} on every target"
    return False, "NotAllUpdated", counts.summary


def progressing(decision: decisions.Decision, details: Sequence[statuses.TargetStatus]) -> Wanted:
    if decision.desired_profile != decision.profile:
        return True, "DwellHolding", decision.reason
    pending = sum(detail.state == "Pending" for detail in details)
    if pending:
        return True, "RolloutPending", f"{pending} targets pending"
    return False, "Stable", ""


def degraded(details: Sequence[statuses.TargetStatus]) -> Wanted:
    failing = [detail for detail in details if detail.state in ("Failed", "Unreachable")]
    if not failing:
        return False, "AllHealthy", ""
    return True, "TargetsFailed", "; ".join(f"{d.name}: {d.message}" for d in failing)


def signals_unavailable(problems: Sequence[str]) -> Wanted:
    if not problems:
        return False, "SignalsAvailable", ""
    return (
        True,
        "SignalsMissing",
        "; ".join(problems) + "; load rules keep their last state, then the schedule decides",
    )


def canary_failed(failure: statuses.FailedSettings | None) -> Wanted:
    if failure is None:
        return False, "NoFailedCanary", ""
    return (
        True,
        "CanaryRolledBack",
        f"{failure.profile}'s settings {failure.settings_hash} failed their canary "
        f"({failure.reason}); the fleet keeps the settings it served until the spec changes",
    )


def pods_contested(contested: Sequence[str]) -> Wanted:
    if not contested:
        return False, "NoOverlap", ""
    return (
        True,
        "GovernedByAnotherPolicy",
        "; ".join(contested) + ": narrow spec.target.selector so that one policy selects each Pod",
    )


def pods_not_injected(pods: Sequence[str]) -> Wanted:
    if not pods:
        return False, "AllInjected", ""
    named = ", ".join(pods)
    if len(pods) > 1 and pods[-1].endswith("more"):  # `kube.pods.NotInjected.selected_by`
        named = f"{', '.join(pods[:-1])} and {pods[-1]}"
    return (
        True,
        "CreatedWithoutInjection",
        f"{named}: opted in ({names.INJECT_SELECTOR}) but created while the admission "
        "webhook did not answer (no operator ran, or it timed out), so without the sidecar, the "
        f"readiness gate and {names.GOVERNED_SELECTOR}: batchpilot cannot switch them, and they "
        "serve their repository's configuration. Delete them: their replacements are injected",
    )


def limit_exceeded(limited: Sequence[str]) -> Wanted:
    if not limited:
        return False, "WithinLimits", ""
    return True, "LimitExceeded", "; ".join(limited)


def lead_time_insufficient(policy: specs.BatchPolicySpec, lead: leads.Lead | None) -> Wanted:
    if lead is None or lead.sufficient:
        return False, "LeadTimeSufficient", ""
    late = lead.expected_rollout - lead.lead
    return (
        True,
        "FleetTooLargeForLead",
        f"rolling out takes {lead.describe()}, longer than schedule.leadTime "
        f"{durations.format_duration(lead.lead.total_seconds())}: the last replicas switch up "
        f"to {durations.format_duration(late.total_seconds())} after a boundary; raise leadTime, "
        f"set it to auto, or raise rollout.maxUnavailable",
    )


def credential_refused(findings: Findings) -> Wanted:
    """Whether the repository credential could not be read, or Triton refused it."""
    if findings.credential_problem is not None:
        return (
            True,
            "SecretUnavailable",
            f"spec.target.repositoryCredential: {findings.credential_problem}; nothing applied",
        )
    outcomes = findings.result.outcomes if findings.result else ()
    refused = [o for o in outcomes if o.error == "credential_refused"]
    if not refused:
        return False, "CredentialAccepted", ""
    return (
        True,
        "RefusedByTriton",
        "; ".join(f"{o.replica.title}: {o.message}" for o in refused)
        + "; those replicas keep the configuration they serve",
    )


def drain_ineffective(
    result: rollouts.Result | None, previous: statuses.BatchPolicyStatus
) -> Wanted:
    """Whether the last drains kept receiving requests; without drains this pass, as before."""
    drained = [o for o in result.outcomes if o.drain is not None] if result else []
    if not drained:
        earlier = next((c for c in previous.conditions if c.type == "DrainIneffective"), None)
        if earlier is None:
            return False, "DrainsEffective", ""
        return earlier.status == "True", earlier.reason, earlier.message
    leaking = [o for o in drained if o.drain is not None and o.drain.ineffective]
    if leaking:
        return (
            True,
            "RequestsKeptArriving",
            "; ".join(drain_message(o) for o in leaking)
            + ": clients hold connections to the Pods (HTTP keep-alive, gRPC channels) instead "
            "of following the Service's endpoints, so their requests waited for the reload; see "
            "the README's hitless-switch section for what to do",
        )
    late = [o for o in drained if o.drain is not None and o.drain.late]
    return (
        False,
        "DrainsEffective",
        "; ".join(drain_message(o) for o in late)
        + (": their leaving reached the Services' proxies late; the drains waited" if late else ""),
    )


def drain_message(outcome: rollouts.Outcome) -> str:
    """What a drain that saw requests after the settle time saw: until its timeout
    (ineffective) or for a while (late)."""
    drain = outcome.drain
    assert drain is not None
    if drain.ineffective:
        return (
            f"{outcome.replica.title} kept receiving requests after it left its Services "
            f"({drain.arrived:g} in {drain.seconds:.1f}s; reloaded after drainTimeoutSeconds)"
        )
    return (
        f"{outcome.replica.title} received {drain.arrived:g} requests after the settle time, "
        f"then none (drained in {drain.seconds:.1f}s)"
    )


def conditions(
    wanted: Mapping[str, Wanted], findings: Findings, previous: statuses.BatchPolicyStatus
) -> list[statuses.Condition]:
    """The conditions, each keeping its transition time while its status stays the same."""
    before = {condition.type: condition for condition in previous.conditions}
    found = []
    for kind, (holds, reason, message) in wanted.items():
        status = "True" if holds else "False"
        earlier = before.get(kind)
        kept = earlier is not None and earlier.status == status
        found.append(
            statuses.Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message[:4096],
                last_transition_time=(earlier.last_transition_time if kept and earlier else None)
                or findings.now,
                observed_generation=findings.generation,
            )
        )
    return found


# The events ------------------------------------------------------------------------------------


def notices(findings: Findings) -> list[Notice]:
    """The events of this reconcile, and the standing problems it began, changed or ended."""
    if findings.problems:
        message = "; ".join(findings.problems)
        found = [Notice(Event("Warning", "InvalidSpec", message), key="InvalidSpec")]
    else:
        found = [Notice(None, key="InvalidSpec")]
    decision, policy = findings.decision, findings.policy
    if decision is not None and policy is not None and decision.switched:
        reason = "DryRunDecision" if policy.dry_run else "ProfileSwitched"
        switch = f"{findings.previous_profile or '(none)'} -> {decision.profile}: {decision.reason}"
        found.insert(0, Notice(Event("Normal", reason, switch)))
    if findings.credential_problem is not None:
        _, _, message = credential_refused(findings)
        found.append(Notice(Event("Warning", "CredentialRefused", message), key="Credential"))
    else:
        found.append(Notice(None, key="Credential"))
    if policy is not None and not findings.problems:
        holds, _, message = lead_time_insufficient(policy, findings.lead)
        event = Event("Warning", "LeadTimeInsufficient", message) if holds else None
        found.append(Notice(event, key="LeadTimeInsufficient"))
        holds, _, message = pods_contested(findings.contested)
        event = Event("Warning", "PodsContested", message) if holds else None
        found.append(Notice(event, key="PodsContested"))
        holds, _, message = pods_not_injected(findings.not_injected)
        event = Event("Warning", "PodsNotInjected", message) if holds else None
        found.append(Notice(event, key="PodsNotInjected"))
        holds, _, message = limit_exceeded(findings.limited)
        event = Event("Warning", "LimitExceeded", message) if holds else None
        found.append(Notice(event, key="LimitExceeded"))
    if findings.result is not None:
        found.extend(target_notice(outcome) for outcome in findings.result.outcomes)
        found.extend(drain_notices(findings.result))
        found.extend(
            Notice(Event("Warning", "ContainerRestarted", message))
            for message in findings.result.restarts
        )
        found.extend(
            Notice(Event(note.type, note.reason, note.message)) for note in findings.canary_notes
        )
        rolled_out = rolled_out_event(findings.result)
        if rolled_out is not None:
            found.append(Notice(rolled_out))
    return found


def drain_notices(result: rollouts.Result) -> list[Notice]:
    """One warning per Pod whose drain did not stop its requests, every time it happens."""
    return [
        Notice(Event("Warning", "DrainIneffective", drain_message(outcome)))
        for outcome in result.outcomes
        if outcome.drain is not None and outcome.drain.ineffective
    ]


def target_notice(outcome: rollouts.Outcome) -> Notice:
    key = f"target/{outcome.replica.name}"
    if outcome.state == "Unreachable":
        reason = "TargetUnreachable"
    elif outcome.state == "Failed":
        reason = {"rejected": "RolledBack", "credential_refused": "CredentialRefused"}.get(
            outcome.error or "", "ApplyFailed"
        )
    else:
        return Notice(None, key=key)
    return Notice(Event("Warning", reason, f"{outcome.replica.title}: {outcome.message}"), key=key)


def rolled_out_event(result: rollouts.Result) -> Event | None:
    """Once every replica runs the profile, and this pass reloaded some."""
    total = len(result.outcomes)
    if not result.reloads or result.count("Updated") != total:
        return None
    profile = result.outcomes[0].profile
    return Event(
        "Normal",
        "RolledOut",
        f"{profile} on {total}/{total} targets in {result.seconds:.1f}s ({result.reloads} reloads)",
    )
