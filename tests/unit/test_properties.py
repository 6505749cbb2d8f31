"""Invariants of the decision engine over generated policies, instants and signals."""

from __future__ import annotations

import datetime
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.policy import decisions, schedules
from builders import make_spec

# Hypothesis runs hundreds of examples: on a loaded 2-core machine that takes minutes, and a
# timeout mid-run reads as a flaky failure, so these get more time than a unit test.
pytestmark = pytest.mark.timeout(300)

ZONES = ["UTC", "America/New_York", "Europe/London", "Asia/Tokyo", "Australia/Sydney"]
PROFILES = ["interactive", "bulk"]
DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]

hhmm = st.builds(
    lambda h, m: f"{h:02d}:{m:02d}", st.integers(0, 23), st.sampled_from([0, 15, 30, 45])
)
windows = st.builds(
    lambda profile, days, start, end: {
        "profile": profile,
        "days": days,
        "start": start,
        "end": end,
    },
    st.sampled_from(PROFILES),
    st.lists(st.sampled_from(DAYS), min_size=1, max_size=7, unique=True),
    hhmm,
    hhmm,
).filter(lambda w: w["start"] != w["end"])
schedules_ = st.builds(
    lambda zone, ws, calendar: {
        "timezone": zone,
        "windows": ws,
        **({"calendar": "XNYS"} if calendar else {}),
    },
    st.sampled_from(ZONES),
    st.lists(windows, max_size=4),
    st.booleans(),
)
instants = st.datetimes(
    min_value=datetime.datetime(2025, 1, 1),
    max_value=datetime.datetime(2027, 12, 31),
    timezones=st.just(datetime.UTC),
)
signal_values = st.dictionaries(
    st.sampled_from(["queueDepth", "requestRate"]), st.floats(0, 1000), max_size=2
)
rule = st.builds(
    lambda profile, metric, above: {"profile": profile, "metric": metric, "above": above},
    st.sampled_from(PROFILES),
    st.sampled_from(["queueDepth", "requestRate"]),
    st.floats(0, 1000),
)
rules = st.lists(rule, max_size=2)


@settings(max_examples=80, deadline=None)
@given(
    schedule=schedules_,
    rule_list=rules,
    now=instants,
    metrics=signal_values,
    dwell=st.integers(0, 3600),
)
def test_exactly_one_known_profile_and_next_transition_in_the_future(
    schedule: dict[str, object],
    rule_list: list[dict[str, object]],
    now: datetime.datetime,
    metrics: dict[str, float],
    dwell: int,
) -> None:
    spec = make_spec(schedule=schedule, load={"rules": rule_list}, minDwellSeconds=dwell)
    decision = decisions.decide(spec, now, decisions.Signals(metrics), decisions.Memory())
    assert decision.profile in spec.profiles
    assert decision.reason
    assert decision.next_transition is None or decision.next_transition > now
    again = decisions.decide(spec, now, decisions.Signals(metrics), decisions.Memory())
    assert again == decision, "a decision is a pure function of its inputs"


@settings(max_examples=100, deadline=None)
@given(
    schedule=schedules_,
    now=instants,
    fractions=st.lists(st.floats(0, 1, exclude_max=True), max_size=5),
)
def test_schedule_profile_holds_until_next_transition_then_changes(
    schedule: dict[str, object], now: datetime.datetime, fractions: list[float]
) -> None:
    spec = make_spec(schedule=schedule)
    first = decisions.decide(spec, now, decisions.Signals(), decisions.Memory())
    if first.next_transition is None:
        return
    span = first.next_transition - now
    for fraction in fractions:
        # timedelta * float rounds to microseconds; stay strictly before the transition.
        instant = min(
            now + span * fraction, first.next_transition - datetime.timedelta(microseconds=1)
        )
        assert (
            decisions.decide(spec, instant, decisions.Signals(), decisions.Memory()).profile
            == first.profile
        )
    at_change = decisions.decide(
        spec, first.next_transition, decisions.Signals(), decisions.Memory()
    )
    assert at_change.profile != first.profile


@settings(max_examples=100, deadline=None)
@given(schedule=schedules_, now=instants)
def test_next_change_is_a_real_change(schedule: dict[str, object], now: datetime.datetime) -> None:
    spec = make_spec(schedule=schedule)
    assert spec.schedule is not None
    change = schedules.next_change(spec.schedule, now)
    if change is not None:
        instant, profile = change
        assert instant > now
        assert schedules.profile_at(spec.schedule, instant) == profile
        assert schedules.profile_at(spec.schedule, now) != profile


@settings(max_examples=100, deadline=None)
@given(
    rule_list=st.lists(rule, min_size=1, max_size=2),
    ticks=st.lists(st.tuples(st.integers(1, 120), signal_values), min_size=1, max_size=12),
    dwell=st.integers(0, 600),
)
def test_no_switch_before_dwell_without_an_override(
    rule_list: list[dict[str, object]], ticks: list[tuple[int, dict[str, float]]], dwell: int
) -> None:
    spec = make_spec(load={"rules": rule_list}, minDwellSeconds=dwell)
    now = datetime.datetime(2026, 11, 24, tzinfo=datetime.UTC)
    memory = decisions.Memory()
    switches: list[datetime.datetime] = []
    for step, metrics in ticks:
        now += datetime.timedelta(seconds=step)
        decision = decisions.decide(spec, now, decisions.Signals(metrics), memory)
        if decision.switched:
            switches.append(now)
        memory = decision.memory
    for earlier, later in itertools.pairwise(switches):
        assert (later - earlier).total_seconds() >= dwell


@settings(max_examples=60, deadline=None)
@given(
    schedule=schedules_,
    now=instants,
    lead_minutes=st.integers(0, 180),
)
def test_a_lead_only_brings_a_change_into_a_latency_profile_forward(
    schedule: dict[str, object], now: datetime.datetime, lead_minutes: int
) -> None:
    spec = make_spec(schedule=schedule)
    lead = datetime.timedelta(minutes=lead_minutes)
    natural = decisions.decide(spec, now, decisions.Signals(), decisions.Memory())
    early = decisions.decide(spec, now, decisions.Signals(), decisions.Memory(), lead=lead)
    assert early.rollout_starts is None or early.rollout_starts >= now
    if early.profile == natural.profile:
        return
    # It is the profile of the next change, which comes within the lead, from throughput into
    # latency (the sample policy: bulk is the throughput profile, interactive the latency one).
    assert natural.next_transition is not None
    assert natural.next_transition - now <= lead
    assert schedules.profile_at(spec.schedule, natural.next_transition) == early.profile
    assert (natural.profile, early.profile) == ("bulk", "interactive")
