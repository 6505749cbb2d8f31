"""The decision: which profile applies now, why, and until when.

`decide` is the only place a profile is chosen. The operator, the standalone runner and
`batchpilot explain` all call it, with the time and the signals as plain arguments and the
previous call's memory handed back in, so every decision can be replayed and tested.

Precedence: an unexpired override, then the first load rule that holds, then the first schedule
window that covers the instant, then `defaultProfile`. A switch waits until the current profile
has been active for `minDwellSeconds`, except a switch an override demands.

Lead time: a scheduled change from a throughput profile into a latency profile is decided `lead`
before its boundary, so that the rollout is over and the latency profile in force at the
boundary itself. Leaving a latency profile is never early. Instants are compared in UTC, so a
lead is the same length across a clock change.

SLO guard: while a profile the objective governs is in force and the p95 measured under the
queue delay in force (it has held for `guardIntervalSeconds`) is above the objective, the delay
drops at once, without autotune's hysteresis: to the sidecars' recommendation where that is
lower, else to half; it returns to the profile's (or autotune's) once the p95 has stayed within
the objective that long.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from batchpilot.api import durations
from batchpilot.api.v1alpha1 import specs
from batchpilot.policy import calendars, loads, rendering, schedules

Source = Literal["override", "load", "schedule", "default"]
GuardAction = Literal["lowered", "restored"]
NO_LEAD = datetime.timedelta(0)
GUARD_FACTOR = 0.5
"""A breach halves the queue delay in force."""
RECOMMENDED_QUEUE_DELAY = "recommendedQueueDelayMicroseconds"
"""Signal name of the sidecar's queue-delay recommendation, used by SLO autotune."""
RECOMMENDED_MAX_NUM_SEQS = "recommendedMaxNumSeqs"
RECOMMENDED_MAX_NUM_BATCHED_TOKENS = "recommendedMaxNumBatchedTokens"
"""Signal names of the sidecars' LLM engine limits for slo.itlP95Ms and slo.ttftP95Ms: shown
(`batchpilot explain`, the batchpilot_signal gauge), never applied."""
RECOMMENDATIONS = (
    RECOMMENDED_QUEUE_DELAY,
    RECOMMENDED_MAX_NUM_SEQS,
    RECOMMENDED_MAX_NUM_BATCHED_TOKENS,
)
AUTOTUNE_RELATIVE_CHANGE = 0.25
"""Autotune keeps the delay in force until a recommendation differs from it by more than this
fraction of it: every change reloads the model, and a reload stalls its requests."""
AUTOTUNE_MIN_CHANGE_MICROSECONDS = 200
"""...and by more than this, so that delays near zero do not flap either."""


@dataclass(frozen=True)
class Signals:
    """Live measurements, by load-metric name; a metric that could not be read is absent."""

    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    """What a decision hands to the next one."""

    profile: str | None = None
    """The profile decided last time."""
    since: datetime.datetime | None = None
    """When that profile was switched to."""
    rules: Mapping[str, loads.RuleState] = field(default_factory=dict)
    """Load-rule states by `loads.rule_key`."""
    tuned_delay_microseconds: int | None = None
    """The queue delay SLO autotune keeps in force for `profile`; None when it sets none."""
    guard: Guard | None = None
    """The SLO guard's state while it holds the queue delay down."""
    delay_microseconds: int | None = None
    """The queue delay in force after the decision."""
    delay_since: datetime.datetime | None = None
    """Since when that delay has been in force: a p95 measured earlier was measured under
    another one."""


@dataclass(frozen=True)
class Guard:
    """The SLO guard holding the queue delay down."""

    delay_microseconds: int
    """The delay the guard keeps in force."""
    changed_at: datetime.datetime
    """When it last lowered the delay."""
    within_since: datetime.datetime | None = None
    """Since when the p95 has been within the objective again."""


@dataclass(frozen=True)
class Decision:
    profile: str
    """The profile to run now."""
    desired_profile: str
    """The profile the rules ask for; differs from `profile` while dwell holds a switch back."""
    source: Source
    """What chose the desired profile."""
    reason: str
    next_transition: datetime.datetime | None
    """When the decision next changes as far as the clock can tell; None if nothing is due."""
    settings: rendering.Settings
    memory: Memory
    switched: bool
    """Whether `profile` differs from the previous decision's."""
    rollout_starts: datetime.datetime | None = None
    """When the next scheduled change is decided: `next_transition`, or `lead` before it for a
    change that starts early."""
    guard: GuardAction | None = None
    """What the SLO guard did in this decision, if anything."""


@dataclass(frozen=True)
class _Wish:
    profile: str
    source: Source
    reason: str


def decide(
    spec: specs.BatchPolicySpec,
    now: datetime.datetime,
    signals: Signals,
    memory: Memory,
    *,
    lead: datetime.timedelta = NO_LEAD,
) -> Decision:
    """Decide the profile for instant `now` (an aware datetime), starting a scheduled change
    into a latency profile `lead` before its boundary."""
    if now.tzinfo is None:
        raise ValueError("decide() needs an aware datetime; naive times are ambiguous")
    now = now.astimezone(datetime.UTC)  # same-zone datetimes compare by wall clock

    rule_states, load_wish, pending = _evaluate_load_rules(spec, now, signals, memory)
    wish = _override_wish(spec, now) or load_wish or _schedule_wish(spec, now, lead)
    if pending:
        wish = _Wish(wish.profile, wish.source, f"{wish.reason} ({'; '.join(pending)})")

    current = memory.profile if memory.profile in spec.profiles else None
    dwell = datetime.timedelta(seconds=spec.min_dwell_seconds)
    dwell_ends = memory.since + dwell if memory.since and current else None
    held = (
        current is not None
        and wish.profile != current
        and wish.source != "override"
        and dwell_ends is not None
        and now < dwell_ends
    )
    rollout_starts: datetime.datetime | None
    if held:
        assert current is not None
        assert dwell_ends is not None
        profile = current
        reason = (
            f"holding {current} until {durations.format_instant(dwell_ends)} (minDwellSeconds="
            f"{spec.min_dwell_seconds}), then {wish.profile}: {wish.reason}"
        )
        next_transition: datetime.datetime | None = dwell_ends
        rollout_starts = dwell_ends
    else:
        profile = wish.profile
        reason = wish.reason
        next_transition, rollout_starts = _next_transition(spec, now, wish, lead)

    switched = profile != memory.profile
    since = now if switched else memory.since
    # A switch starts tuning afresh: the delay tuned for one profile says nothing about another.
    settings, tuned = _settings(
        spec, profile, signals, None if switched else memory.tuned_delay_microseconds
    )
    settled = (
        not switched
        and memory.delay_since is not None
        and spec.slo is not None
        and now - memory.delay_since >= datetime.timedelta(seconds=spec.slo.guard_interval_seconds)
    )
    settings, guard, guarded = _guarded(
        spec, profile, signals, now, settings, None if switched else memory.guard, settled=settled
    )
    delay = settings.dynamic_batching["max_queue_delay_microseconds"]
    delay_since = memory.delay_since if not switched and memory.delay_microseconds == delay else now
    if guarded is not None:
        reason = f"{reason}; {guarded}"
    if next_transition is not None and since is not None and not held:
        # A scheduled change that lands inside the dwell happens when the dwell ends.
        next_transition = max(next_transition, since + dwell)
        rollout_starts = max(rollout_starts or next_transition, since + dwell)
    return Decision(
        profile=profile,
        desired_profile=wish.profile,
        source=wish.source,
        reason=reason,
        next_transition=next_transition,
        settings=settings,
        memory=Memory(
            profile=profile,
            since=since,
            rules=rule_states,
            tuned_delay_microseconds=tuned,
            guard=guard,
            delay_microseconds=delay,
            delay_since=delay_since,
        ),
        switched=switched,
        rollout_starts=rollout_starts,
        guard=_guard_action(memory.guard if not switched else None, guard),
    )


def steady_memory(spec: specs.BatchPolicySpec, signals: Signals) -> Memory:
    """Memory as if `signals` had held steady for longer than any rule's `for`, with no profile
    decided yet: the premise of a point-in-time question such as `batchpilot explain`."""
    rules = spec.load.rules if spec.load else []
    return Memory(
        rules={
            loads.rule_key(number, rule): loads.steady_state(rule, signals.metrics)
            for number, rule in enumerate(rules, start=1)
        }
    )


def _override_wish(spec: specs.BatchPolicySpec, now: datetime.datetime) -> _Wish | None:
    override = spec.override
    if override is None or (override.until is not None and now >= override.until):
        return None
    until = f" until {durations.format_instant(override.until)}" if override.until else ""
    why = f": {override.reason}" if override.reason else ""
    return _Wish(override.profile, "override", f"override to {override.profile}{until}{why}")


def _evaluate_load_rules(
    spec: specs.BatchPolicySpec,
    now: datetime.datetime,
    signals: Signals,
    memory: Memory,
) -> tuple[dict[str, loads.RuleState], _Wish | None, list[str]]:
    """Advance every rule, even when an override wins, so none lags when control returns.

    Returns the new states, the first holding rule's wish, and notes on rules that are
    counting towards a change, so a reason can say a switch is coming."""
    states: dict[str, loads.RuleState] = {}
    wish: _Wish | None = None
    pending: list[str] = []
    for number, rule in enumerate(spec.load.rules if spec.load else [], start=1):
        key = loads.rule_key(number, rule)
        outcome = loads.evaluate(
            rule, memory.rules.get(key, loads.RuleState()), signals.metrics, now
        )
        states[key] = outcome.state
        if wish is None and outcome.state.holding:
            wish = _Wish(
                rule.profile,
                "load",
                f"load rule #{number} ({loads.describe(rule)}) holds: {outcome.explanation}",
            )
        elif outcome.state.crossing_since is not None or outcome.state.missing_since is not None:
            pending.append(f"load rule #{number}: {outcome.explanation}")
    return states, wish, pending


def _schedule_wish(
    spec: specs.BatchPolicySpec, now: datetime.datetime, lead: datetime.timedelta
) -> _Wish:
    """What the clock asks for now, or the next window's profile if its change starts early."""
    natural = _scheduled_now(spec, now)
    upcoming = _upcoming_change(spec, now) if lead > NO_LEAD else None
    if upcoming is None:
        return natural
    boundary, profile, description = upcoming
    if boundary - now <= lead and _starts_early(spec, natural.profile, profile):
        return _Wish(
            profile,
            "schedule",
            f"{description}, in force from {durations.format_instant(boundary)}: rolled out "
            f"{durations.format_duration(lead.total_seconds())} ahead (schedule.leadTime)",
        )
    return natural


def _starts_early(spec: specs.BatchPolicySpec, leaving: str, entering: str) -> bool:
    """Only a change from a throughput profile into a latency profile is made early: a latency
    window is never cut short for it."""
    return (
        leaving != entering
        and spec.profile_role(leaving) == "throughput"
        and spec.profile_role(entering) == "latency"
    )


def _upcoming_change(
    spec: specs.BatchPolicySpec, now: datetime.datetime
) -> tuple[datetime.datetime, str, str] | None:
    """The next instant the clock's profile changes: when, to what, and why."""
    schedule = spec.schedule
    if schedule is None:
        return None
    change = schedules.next_change(schedule, now)
    if change is None:
        return None
    boundary, window_profile = change
    occurrence = schedules.active_occurrence(schedule, boundary)
    if window_profile is not None and occurrence is not None:
        return boundary, window_profile, f"schedule {schedules.describe(occurrence, schedule)}"
    return boundary, spec.default_profile, "defaultProfile once the window ends"


def _scheduled_now(spec: specs.BatchPolicySpec, now: datetime.datetime) -> _Wish:
    schedule = spec.schedule
    occurrence = schedules.active_occurrence(schedule, now) if schedule else None
    if schedule and occurrence:
        return _Wish(
            occurrence.window.profile,
            "schedule",
            f"schedule {schedules.describe(occurrence, schedule)}",
        )
    return _Wish(spec.default_profile, "default", _why_default(schedule, now))


def _why_default(schedule: specs.Schedule | None, now: datetime.datetime) -> str:
    if schedule is None or not schedule.windows:
        return "defaultProfile (no schedule windows)"
    local = now.astimezone(schedule.zone)
    day = local.date()
    if day in schedule.exceptions:
        detail = f"{day.isoformat()} is an exception date"
    elif schedule.calendar and calendars.session_on(schedule.calendar, day) is None:
        detail = f"{day.isoformat()} is not a trading day on {schedule.calendar}"
    elif schedule.calendar and schedules.active_occurrence(
        schedule.model_copy(update={"calendar": None}), now
    ):
        detail = f"{local.strftime('%H:%M %Z')} is outside the {schedule.calendar} session"
    else:
        detail = f"no window covers {local.strftime('%a %Y-%m-%d %H:%M %Z')}"
    return f"defaultProfile: {detail}"


def _next_transition(
    spec: specs.BatchPolicySpec, now: datetime.datetime, wish: _Wish, lead: datetime.timedelta
) -> tuple[datetime.datetime | None, datetime.datetime | None]:
    """When the decision next changes by the clock, and when that change is decided (earlier by
    `lead` for a change that starts early)."""
    if wish.source == "override":
        until = spec.override.until if spec.override else None
        return until, until
    if wish.source == "load" or spec.schedule is None:
        # A load rule lets go when the load falls, which no clock can tell.
        return None, None
    horizon = now + datetime.timedelta(days=schedules.LOOKAHEAD_DAYS)
    instant = now
    while instant < horizon:
        change = schedules.next_change(spec.schedule, instant)
        if change is None:
            return None, None
        instant, window_profile = change
        profile = window_profile or spec.default_profile
        if profile != wish.profile:
            early = _starts_early(spec, wish.profile, profile)
            return instant, max(instant - lead, now) if early else instant
    return None, None


def _settings(
    spec: specs.BatchPolicySpec, profile: str, signals: Signals, tuned: int | None
) -> tuple[rendering.Settings, int | None]:
    """The profile's settings, with the autotuned queue delay where the objective governs it.

    Returns the delay autotune keeps in force, for the next decision. A recommendation close to
    that delay leaves it alone, and so does a missing one (a sidecar that did not answer once),
    so that the model is not reloaded for nothing."""
    slo = spec.slo
    # autotune needs p95LatencyMs (a CEL rule); a policy object built in code may lack it.
    if (
        slo is None
        or not slo.autotune
        or slo.p95_latency_ms is None
        or not spec.slo_governs(profile)
    ):
        return rendering.render(spec.profiles[profile]), None

    def clamped(delay: float) -> int:
        low, high = slo.min_queue_delay_microseconds, slo.max_queue_delay_microseconds
        return min(max(round(delay), low), high)

    recommended = signals.metrics.get(RECOMMENDED_QUEUE_DELAY)
    if recommended is not None:
        candidate = clamped(recommended)
        if tuned is None or abs(candidate - tuned) > max(
            AUTOTUNE_RELATIVE_CHANGE * tuned, AUTOTUNE_MIN_CHANGE_MICROSECONDS
        ):
            tuned = candidate
    if tuned is None:
        return rendering.render(spec.profiles[profile]), None
    tuned = clamped(tuned)  # the bounds may have changed since it was tuned
    return rendering.render(spec.profiles[profile], queue_delay_microseconds=tuned), tuned


def _guarded(
    spec: specs.BatchPolicySpec,
    profile: str,
    signals: Signals,
    now: datetime.datetime,
    settings: rendering.Settings,
    guard: Guard | None,
    *,
    settled: bool,
) -> tuple[rendering.Settings, Guard | None, str | None]:
    """The settings with the SLO guard applied, its state for the next decision, and what it
    says for the reason. It acts on a breach only once the delay in force has `settled` (the
    p95 was measured under it); without a p95 reading it stays as it was."""
    slo = spec.slo
    if slo is None or not slo.guard or slo.p95_latency_ms is None or not spec.slo_governs(profile):
        return settings, None, None
    objective = slo.p95_latency_ms
    p95 = signals.metrics.get("p95LatencyMs")
    interval = datetime.timedelta(seconds=slo.guard_interval_seconds)
    in_force = settings.dynamic_batching["max_queue_delay_microseconds"]
    if guard is not None:
        in_force = min(in_force, guard.delay_microseconds)
    if p95 is not None and p95 > objective:
        recommended = signals.metrics.get(RECOMMENDED_QUEUE_DELAY)
        lowered = round(in_force * GUARD_FACTOR)
        if recommended is not None and recommended < in_force:
            lowered = round(recommended)
        lowered = max(lowered, slo.min_queue_delay_microseconds)
        if settled and lowered < in_force:
            guard = Guard(delay_microseconds=lowered, changed_at=now)
        elif guard is not None:
            guard = dataclasses.replace(guard, within_since=None)
    elif p95 is not None and guard is not None:
        within_since = guard.within_since or now
        if now - within_since >= interval and now - guard.changed_at >= interval:
            return settings, None, f"SLO guard off: p95 within {objective:g} ms"
        guard = dataclasses.replace(guard, within_since=within_since)
    if guard is None:
        return settings, None, None
    held = dict(settings.dynamic_batching, max_queue_delay_microseconds=guard.delay_microseconds)
    # No figure in the note: a reason that quoted the live p95 would rewrite the status each pass.
    if p95 is None:
        seen = "no p95 reading"
    elif guard.within_since is not None:
        seen = f"p95 within {objective:g} ms since {durations.format_instant(guard.within_since)}"
    else:
        seen = f"p95 above {objective:g} ms"
    note = f"SLO guard: {seen}, queue delay held at {guard.delay_microseconds} us"
    return rendering.Settings(held, settings.max_batch_size), guard, note


def _guard_action(before: Guard | None, after: Guard | None) -> GuardAction | None:
    if after is not None and (before is None or after.changed_at != before.changed_at):
        return "lowered"
    if before is not None and after is None:
        return "restored"
    return None
