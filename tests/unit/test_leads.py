"""Lead time: a change into a latency profile is decided early enough to be in force at its
boundary; leaving one is never early; the lead is real time across clock changes; `auto` comes
from the policy's own rollouts."""

from __future__ import annotations

import datetime

import crd_checks
import pytest

from batchpilot.api import documents
from batchpilot.policy import decisions, leads
from builders import make_spec, market_hours, ny, spec_document, utc, window

MINUTE = datetime.timedelta(minutes=1)
QUIET = decisions.Signals()


def decide(spec: object, now: datetime.datetime, lead: datetime.timedelta) -> decisions.Decision:
    return decisions.decide(spec, now, QUIET, decisions.Memory(), lead=lead)  # type: ignore[arg-type]


def test_a_change_into_a_latency_window_is_decided_the_lead_before_its_boundary() -> None:
    spec = make_spec(schedule=market_hours())
    before = decide(spec, ny(2026, 11, 24, 9, 28), MINUTE)
    assert before.profile == "bulk"
    assert before.next_transition == ny(2026, 11, 24, 9, 30)
    assert before.rollout_starts == ny(2026, 11, 24, 9, 29)
    early = decide(spec, ny(2026, 11, 24, 9, 29), MINUTE)
    assert (early.profile, early.source) == ("interactive", "schedule")
    assert "in force from 2026-11-24T14:30:00Z: rolled out 1m ahead" in early.reason
    assert early.next_transition == ny(2026, 11, 24, 16)


def test_leaving_a_latency_window_is_never_early() -> None:
    spec = make_spec(schedule=market_hours())
    last_minute = decide(spec, ny(2026, 11, 24, 15, 59, 30), 10 * MINUTE)
    assert last_minute.profile == "interactive"
    assert last_minute.rollout_starts == last_minute.next_transition == ny(2026, 11, 24, 16)


def test_an_early_close_ends_the_latency_profile_at_the_close_not_before() -> None:
    spec = make_spec(schedule=market_hours(calendar="XNYS"))
    decision = decide(spec, ny(2026, 11, 27, 12, 59), 10 * MINUTE)
    assert decision.profile == "interactive"
    assert decision.rollout_starts == ny(2026, 11, 27, 13)


def test_a_lead_across_a_clock_change_is_real_time() -> None:
    # New York springs forward at 02:00 on 2026-03-08: 03:00 EDT is 07:00 UTC, and 90 minutes
    # before it is 05:30 UTC, which is 00:30 EST on the clock.
    spec = make_spec(
        schedule=market_hours(windows=[window("interactive", "03:00", "06:00", ["Sun"])])
    )
    decision = decide(spec, utc(2026, 3, 8, 5), 90 * MINUTE)
    assert decision.next_transition == utc(2026, 3, 8, 7)
    assert decision.rollout_starts == utc(2026, 3, 8, 5, 30)


def test_no_lead_changes_at_the_boundary() -> None:
    spec = make_spec(schedule=market_hours())
    decision = decide(spec, ny(2026, 11, 24, 9, 29, 59), datetime.timedelta(0))
    assert decision.profile == "bulk"
    assert decision.rollout_starts == ny(2026, 11, 24, 9, 30)


def test_a_switch_between_two_latency_profiles_is_not_early() -> None:
    spec = make_spec(
        profiles={
            "open": {"maxQueueDelayMicroseconds": 1000, "role": "latency"},
            "session": {"maxQueueDelayMicroseconds": 2000, "role": "latency"},
        },
        defaultProfile="open",
        schedule=market_hours(windows=[window("session", "09:30", "16:00")]),
    )
    assert decide(spec, ny(2026, 11, 24, 9, 29), 10 * MINUTE).profile == "open"


def test_auto_lead_covers_every_wave_with_a_margin() -> None:
    spec = make_spec(schedule=market_hours(), rollout={"maxUnavailable": 2})
    lead = leads.lead_for(spec, replicas=8, wave_seconds=3.0)
    assert (lead.waves, lead.measured) == (4, True)
    assert lead.expected_rollout == datetime.timedelta(seconds=12)
    assert lead.lead == datetime.timedelta(seconds=12 * leads.MARGIN_FACTOR + leads.MARGIN_SECONDS)
    assert lead.sufficient


def test_auto_lead_assumes_a_conservative_wave_until_one_is_measured() -> None:
    lead = leads.lead_for(make_spec(schedule=market_hours()), replicas=3, wave_seconds=None)
    assert lead.expected_rollout == datetime.timedelta(seconds=3 * leads.DEFAULT_WAVE_SECONDS)
    assert not lead.measured


def test_a_fixed_lead_shorter_than_the_rollout_is_insufficient() -> None:
    spec = make_spec(schedule=market_hours(leadTime="30s"))
    lead = leads.lead_for(spec, replicas=32, wave_seconds=2.0)
    assert lead.lead == datetime.timedelta(seconds=30)
    assert not lead.sufficient
    assert lead.describe() == "32 waves of 2.0s (measured), about 1m4s"


def test_a_zero_lead_is_always_sufficient() -> None:
    spec = make_spec(schedule=market_hours(leadTime="0s"))
    assert leads.lead_for(spec, replicas=32, wave_seconds=2.0).sufficient


def test_a_wave_is_the_rollout_over_the_waves_it_needed() -> None:
    assert leads.wave_seconds(9.0, switched=5, max_unavailable=2) == 3.0
    assert leads.wave_seconds(9.0, switched=0, max_unavailable=2) is None


@pytest.mark.parametrize(
    ("lead", "admitted"),
    [("auto", True), ("0s", True), ("8h", True), ("8h1m", False), ("1h30m", True)],
)
def test_a_lead_may_be_as_long_as_a_window_that_crosses_midnight(lead: str, admitted: bool) -> None:
    night = market_hours(windows=[window("interactive", "22:00", "06:00")], leadTime=lead)
    document = spec_document(schedule=night)
    assert (crd_checks.admission_errors(document) == []) is admitted
    assert (documents_accept(document)) is admitted


def documents_accept(document: dict[str, object]) -> bool:
    try:
        documents.parse_spec(document)
    except documents.PolicyError:
        return False
    return True


def wave(start: int, end: int, seconds: float) -> leads.Wave:
    at = datetime.datetime(2026, 11, 24, 14, 0, tzinfo=datetime.UTC)
    return leads.Wave(
        at + datetime.timedelta(seconds=start), at + datetime.timedelta(seconds=end), seconds
    )


def test_contention_is_the_longest_wave_beside_one_of_ours_on_our_nodes() -> None:
    contention = leads.Contention()
    ours = wave(0, 4, 4.0)
    contention.record(["node-a"], ours)
    contention.record(["node-a", "node-b"], wave(1, 10, 9.0))
    contention.record(["node-b"], wave(0, 30, 30.0))
    contention.record(["node-a"], wave(60, 90, 30.0))
    assert contention.busiest(["node-a"], [ours]) == 9.0
    assert contention.busiest(["node-c"], [ours]) is None
    assert contention.busiest(["node-a"], []) is None


def test_contention_forgets_a_node_quiet_for_a_week() -> None:
    contention = leads.Contention(per_node=2)
    contention.record(["old"], wave(0, 5, 5.0))
    later = wave(0, 5, 5.0)
    later = leads.Wave(
        later.started + leads.NODE_HORIZON * 2, later.ended + leads.NODE_HORIZON * 2, 1.0
    )
    contention.record(["new"], later)
    assert contention.busiest(["old"], [wave(0, 5, 5.0)]) is None
    for _ in range(5):
        contention.record(["new"], later)
    assert len(contention._waves["new"]) == 2


def test_a_contended_wave_longer_than_its_own_sets_the_lead_and_says_so() -> None:
    spec = make_spec(schedule=market_hours(leadTime="30s"))
    lead = leads.lead_for(spec, replicas=2, wave_seconds=2.0, contended_wave_seconds=9.0)
    assert (lead.wave_seconds, lead.measured, lead.contended) == (9.0, True, True)
    assert (
        lead.describe()
        == "2 waves of 9.0s (measured beside other rollouts on its nodes), about 18s"
    )
    shorter = leads.lead_for(spec, replicas=2, wave_seconds=2.0, contended_wave_seconds=1.0)
    assert (shorter.wave_seconds, shorter.contended) == (2.0, False)
    unmeasured = leads.lead_for(spec, replicas=2, wave_seconds=None, contended_wave_seconds=3.0)
    assert (unmeasured.wave_seconds, unmeasured.measured) == (3.0, True)


def test_auto_lead_plans_a_canary_s_wave_and_analysis_for_settings_not_proven() -> None:
    """A first switch into a new interactive waits out the canary before the rest follow."""
    canary = {"replicas": 1, "analysisSeconds": 60}
    spec = make_spec(schedule=market_hours(), rollout={"maxUnavailable": 2, "canary": canary})
    proven = leads.lead_for(spec, replicas=8, wave_seconds=3.0)
    new = leads.lead_for(spec, replicas=8, wave_seconds=3.0, through_canary=True)
    assert proven.expected_rollout == datetime.timedelta(seconds=12)
    assert new.expected_rollout == datetime.timedelta(seconds=12 + 3 + 60)
    assert new.lead == datetime.timedelta(seconds=75 * leads.MARGIN_FACTOR + leads.MARGIN_SECONDS)
    assert new.describe() == (
        "4 waves of 3.0s (measured) after a canary's wave and analysis (63s), about 1m15s"
    )
    fixed = make_spec(schedule=market_hours(leadTime="30s"), rollout={"canary": canary})
    assert not leads.lead_for(fixed, replicas=2, wave_seconds=3.0, through_canary=True).sufficient
    uncanaried = make_spec(schedule=market_hours())
    assert leads.lead_for(uncanaried, replicas=8, wave_seconds=3.0, through_canary=True) == (
        leads.lead_for(uncanaried, replicas=8, wave_seconds=3.0)
    ), "no canary, nothing to wait for"
