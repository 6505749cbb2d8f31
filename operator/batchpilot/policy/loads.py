"""Load rules as small state machines with hysteresis.

A rule starts to hold once its metric has stayed above `above` for `for`, and lets go once it
has stayed below `below` (default `above`) for `for`, so a metric hovering near one threshold
cannot make the fleet flap. A missing signal is not evidence either way: the rule keeps its
state for a grace period, then lets go, so a dead sidecar hands control back to the schedule
instead of pinning a load profile forever.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, replace

from batchpilot.api import durations
from batchpilot.api.v1alpha1 import specs

# How long a holding rule survives missing signals when its `for` is shorter than this.
MISSING_SIGNAL_GRACE = datetime.timedelta(seconds=30)


@dataclass(frozen=True)
class RuleState:
    """What one rule remembers between evaluations."""

    holding: bool = False
    crossing_since: datetime.datetime | None = None
    """When the metric first crossed the threshold that would flip `holding`."""
    missing_since: datetime.datetime | None = None


@dataclass(frozen=True)
class RuleOutcome:
    state: RuleState
    value: float | None
    explanation: str


def rule_key(index: int, rule: specs.LoadRule) -> str:
    """Identifies a rule across spec edits: its state carries over only if it is unchanged."""
    return (
        f"{index}:{rule.profile}:{rule.metric}>{rule.above}<{rule.release_below}"
        f"/{rule.hold_seconds}s"
    )


def describe(rule: specs.LoadRule) -> str:
    return f"{rule.metric} > {rule.above:g}{_for(rule)}"


def evaluate(
    rule: specs.LoadRule,
    state: RuleState,
    signals: Mapping[str, float],
    now: datetime.datetime,
) -> RuleOutcome:
    """Advance one rule by one observation."""
    hold_for = datetime.timedelta(seconds=rule.hold_seconds)
    value = signals.get(rule.metric)
    if value is None:
        missing_since = state.missing_since or now
        grace = max(hold_for, MISSING_SIGNAL_GRACE)
        unavailable = f"{rule.metric} unavailable since {durations.format_instant(missing_since)}"
        if state.holding and now - missing_since < grace:
            return RuleOutcome(
                replace(state, crossing_since=None, missing_since=missing_since),
                None,
                f"{unavailable}; the rule stays held until "
                f"{durations.format_instant(missing_since + grace)}",
            )
        return RuleOutcome(RuleState(missing_since=missing_since), None, unavailable)

    crossing = value < rule.release_below if state.holding else value > rule.above
    if not crossing:
        return RuleOutcome(RuleState(holding=state.holding), value, _status(rule, state))
    crossing_since = state.crossing_since or now
    if now - crossing_since >= hold_for:
        flipped = RuleState(holding=not state.holding)
        return RuleOutcome(flipped, value, _status(rule, flipped))
    threshold = f"< {rule.release_below:g}" if state.holding else f"> {rule.above:g}"
    flips = "lets go" if state.holding else "holds"
    return RuleOutcome(
        RuleState(holding=state.holding, crossing_since=crossing_since),
        value,
        f"{rule.metric} {threshold} since {durations.format_instant(crossing_since)}; "
        f"{flips} at {durations.format_instant(crossing_since + hold_for)}",
    )


def _status(rule: specs.LoadRule, state: RuleState) -> str:
    """Where a rule stands, without the metric's value: a reason that quoted live figures would
    change, and be written to the status, on every pass (the values are exported as
    `batchpilot_signal`, and `batchpilot explain` prints them)."""
    if state.holding:
        return f"lets go once {rule.metric} < {rule.release_below:g}{_for(rule)}"
    return f"{rule.metric} not > {rule.above:g}"


def _for(rule: specs.LoadRule) -> str:
    return f" for {durations.format_duration(rule.hold_seconds)}" if rule.hold_seconds else ""


def steady_state(rule: specs.LoadRule, signals: Mapping[str, float]) -> RuleState:
    """The state of a rule whose metric has held its current value for long: what `explain`
    assumes of the signals it is given."""
    value = signals.get(rule.metric)
    return RuleState(holding=value is not None and value > rule.above)
