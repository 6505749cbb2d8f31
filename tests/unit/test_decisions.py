"""The decision engine: precedence, overrides, load rules with hysteresis, dwell, rendering."""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.policy import decisions
from builders import make_spec, market_hours, ny, utc

QUIET = decisions.Signals(metrics={"queueDepth": 0})
SECOND = datetime.timedelta(seconds=1)


def busy(depth: float) -> decisions.Signals:
    return decisions.Signals(metrics={"queueDepth": depth})


def run(
    spec: specs.BatchPolicySpec,
    ticks: Iterable[tuple[datetime.datetime, decisions.Signals]],
    memory: decisions.Memory | None = None,
) -> list[decisions.Decision]:
    """Decide at each tick, handing memory forward as the operator does."""
    memory = memory or decisions.Memory()
    made = []
    for now, signals in ticks:
        decision = decisions.decide(spec, now, signals, memory)
        memory = decision.memory
        made.append(decision)
    return made


def queue_rule(**fields: object) -> dict[str, object]:
    return {"rules": [{"profile": "bulk", "metric": "queueDepth", "above": 200, **fields}]}


def test_schedule_window_chooses_interactive_and_names_the_next_transition() -> None:
    spec = make_spec(schedule=market_hours())
    decision = decisions.decide(spec, ny(2026, 11, 24, 10), QUIET, decisions.Memory())
    assert (decision.profile, decision.source) == ("interactive", "schedule")
    assert "window #1" in decision.reason
    assert decision.next_transition == ny(2026, 11, 24, 16)
    assert decision.settings.dynamic_batching["max_queue_delay_microseconds"] == 2000


def test_default_profile_outside_windows_says_why() -> None:
    spec = make_spec(schedule=market_hours(calendar="XNYS"))
    decision = decisions.decide(spec, ny(2026, 11, 26, 10), QUIET, decisions.Memory())
    assert (decision.profile, decision.source) == ("bulk", "default")
    assert "2026-11-26 is not a trading day on XNYS" in decision.reason
    assert decision.next_transition == ny(2026, 11, 27, 9, 30)


def test_early_close_reason_names_the_session() -> None:
    spec = make_spec(schedule=market_hours(calendar="XNYS"))
    decision = decisions.decide(spec, ny(2026, 11, 27, 13, 30), QUIET, decisions.Memory())
    assert decision.profile == "bulk"
    assert "outside the XNYS session" in decision.reason


def test_override_wins_until_it_expires() -> None:
    until = utc(2026, 11, 24, 16)
    spec = make_spec(
        schedule=market_hours(),
        override={"profile": "bulk", "until": until.isoformat(), "reason": "backfill"},
    )
    before = decisions.decide(spec, until - SECOND, QUIET, decisions.Memory())
    assert (before.profile, before.source) == ("bulk", "override")
    assert before.reason == "override to bulk until 2026-11-24T16:00:00Z: backfill"
    assert before.next_transition == until
    after = decisions.decide(spec, until, QUIET, before.memory)
    assert (after.profile, after.source) == ("interactive", "schedule")


def test_override_without_expiry_has_no_next_transition() -> None:
    spec = make_spec(schedule=market_hours(), override={"profile": "bulk"})
    decision = decisions.decide(spec, ny(2026, 11, 24, 10), QUIET, decisions.Memory())
    assert decision.source == "override"
    assert decision.next_transition is None


def test_override_switches_at_once_despite_dwell() -> None:
    spec = make_spec(override={"profile": "interactive"}, minDwellSeconds=3600)
    now = utc(2026, 11, 24, 12)
    memory = decisions.Memory(profile="bulk", since=now - SECOND)
    decision = decisions.decide(spec, now, QUIET, memory)
    assert decision.profile == "interactive"
    assert decision.switched


def test_load_rule_needs_the_metric_above_for_its_duration() -> None:
    spec = make_spec(schedule=market_hours(), load=queue_rule(**{"for": "60s"}))
    start = ny(2026, 11, 24, 10)
    made = run(
        spec,
        [
            (start, busy(250)),
            (start + 30 * SECOND, busy(250)),
            (start + 59 * SECOND, busy(250)),
            (start + 60 * SECOND, busy(250)),
        ],
    )
    assert [d.profile for d in made] == ["interactive", "interactive", "interactive", "bulk"]
    assert made[1].reason.endswith(
        "(load rule #1: queueDepth > 200 since 2026-11-24T15:00:00Z; holds at 2026-11-24T15:01:00Z)"
    )
    assert made[2].reason == made[1].reason, "a rule counting down keeps its reason still"
    assert made[3].source == "load"
    assert "load rule #1 (queueDepth > 200 for 1m)" in made[3].reason


def test_load_rule_timer_restarts_when_the_metric_dips() -> None:
    spec = make_spec(load=queue_rule(**{"for": "60s"}), defaultProfile="interactive")
    start = utc(2026, 11, 24, 12)
    made = run(
        spec,
        [
            (start, busy(250)),
            (start + 40 * SECOND, busy(100)),
            (start + 70 * SECOND, busy(250)),
            (start + 120 * SECOND, busy(250)),
            (start + 130 * SECOND, busy(250)),
        ],
    )
    assert [d.profile for d in made] == ["interactive"] * 4 + ["bulk"]


def test_load_rule_lets_go_only_below_below_for_its_duration() -> None:
    spec = make_spec(load=queue_rule(below=50, **{"for": "30s"}), defaultProfile="interactive")
    start = utc(2026, 11, 24, 12)
    made = run(
        spec,
        [
            (start, busy(300)),
            (start + 30 * SECOND, busy(300)),  # held 30s: bulk
            (start + 60 * SECOND, busy(100)),  # under `above` but not under `below`: stays
            (start + 120 * SECOND, busy(40)),  # under `below`: timer starts
            (start + 149 * SECOND, busy(40)),
            (start + 150 * SECOND, busy(40)),  # 30s under `below`: lets go
        ],
    )
    assert [d.profile for d in made] == [
        "interactive",
        "bulk",
        "bulk",
        "bulk",
        "bulk",
        "interactive",
    ]


@pytest.mark.parametrize(
    ("metric", "above", "below", "high", "between", "low"),
    [
        ("ttftP95Ms", 800, 300, 1500, 500, 120),
        ("interTokenP95Ms", 60, 30, 95, 45, 20),
        ("outputTokensPerSecond", 2000, 800, 3500, 1200, 400),
        ("waitingSequences", 16, 2, 40, 8, 0),
    ],
)
def test_llm_engine_rules_switch_with_hysteresis(
    metric: str, above: float, below: float, high: float, between: float, low: float
) -> None:
    rule = {"profile": "bulk", "metric": metric, "above": above, "below": below, "for": "30s"}
    spec = make_spec(load={"rules": [rule]}, defaultProfile="interactive")
    start = utc(2026, 11, 24, 12)

    def engine(value: float) -> decisions.Signals:
        return decisions.Signals(metrics={metric: value})

    made = run(
        spec,
        [
            (start, engine(high)),
            (start + 29 * SECOND, engine(high)),
            (start + 30 * SECOND, engine(high)),  # above for 30s: bulk
            (start + 60 * SECOND, engine(between)),  # under `above`, not under `below`: stays
            (start + 90 * SECOND, engine(low)),  # under `below`: its timer starts
            (start + 120 * SECOND, engine(low)),  # 30s under `below`: lets go
        ],
    )
    assert [d.profile for d in made] == ["interactive"] * 2 + ["bulk"] * 3 + ["interactive"]
    assert made[1].reason.endswith(
        f"(load rule #1: {metric} > {above:g} since 2026-11-24T12:00:00Z; "
        "holds at 2026-11-24T12:00:30Z)"
    )
    assert made[2].source == "load"
    assert made[3].reason == (
        f"load rule #1 ({metric} > {above:g} for 30s) holds: "
        f"lets go once {metric} < {below:g} for 30s"
    )
    assert made[2].reason == made[3].reason, "the metric's value moves, the reason does not"


def test_missing_signal_keeps_a_held_rule_for_a_grace_then_hands_back_to_the_schedule() -> None:
    spec = make_spec(load=queue_rule(), defaultProfile="interactive")
    start = utc(2026, 11, 24, 12)
    nothing = decisions.Signals()
    made = run(
        spec,
        [
            (start, busy(300)),
            (start + 10 * SECOND, nothing),
            (start + 39 * SECOND, nothing),
            (start + 40 * SECOND, nothing),
        ],
    )
    assert [d.profile for d in made] == ["bulk", "bulk", "bulk", "interactive"]
    assert made[2].reason.endswith(
        "queueDepth unavailable since 2026-11-24T12:00:10Z; "
        "the rule stays held until 2026-11-24T12:00:40Z"
    )
    assert made[1].reason == made[2].reason


def test_missing_signal_never_starts_a_rule() -> None:
    spec = make_spec(load=queue_rule(), defaultProfile="interactive")
    decision = decisions.decide(spec, utc(2026, 11, 24), decisions.Signals(), decisions.Memory())
    assert decision.profile == "interactive"


def test_dwell_holds_the_current_profile_and_says_until_when() -> None:
    spec = make_spec(schedule=market_hours(), minDwellSeconds=300)
    switched_at = ny(2026, 11, 24, 9, 28)
    memory = decisions.Memory(profile="bulk", since=switched_at)
    held = decisions.decide(spec, ny(2026, 11, 24, 9, 30), QUIET, memory)
    assert (held.profile, held.desired_profile) == ("bulk", "interactive")
    assert held.reason.startswith("holding bulk until 2026-11-24T14:33:00Z (minDwellSeconds=300)")
    assert held.next_transition == switched_at + datetime.timedelta(seconds=300)
    assert not held.switched
    released = decisions.decide(spec, held.next_transition, QUIET, held.memory)
    assert released.profile == "interactive"
    assert released.switched


def test_scheduled_change_inside_the_dwell_is_reported_at_the_dwell_end() -> None:
    spec = make_spec(schedule=market_hours(), minDwellSeconds=600)
    decision = decisions.decide(spec, ny(2026, 11, 24, 15, 55), QUIET, decisions.Memory())
    assert decision.profile == "interactive"
    assert decision.next_transition == ny(2026, 11, 24, 16, 5)


def test_first_decision_is_not_held_by_dwell() -> None:
    spec = make_spec(schedule=market_hours(), minDwellSeconds=3600)
    decision = decisions.decide(spec, ny(2026, 11, 24, 10), QUIET, decisions.Memory())
    assert decision.profile == "interactive"
    assert decision.switched


def test_a_removed_profile_is_left_at_once() -> None:
    spec = make_spec(minDwellSeconds=3600)
    now = utc(2026, 11, 24)
    decision = decisions.decide(spec, now, QUIET, decisions.Memory(profile="gone", since=now))
    assert decision.profile == "bulk"


@pytest.mark.parametrize(
    ("override", "depth", "at", "expected"),
    [
        ("interactive", 300, ny(2026, 11, 28, 12), ("interactive", "override")),
        (None, 300, ny(2026, 11, 24, 10), ("bulk", "load")),
        (None, 0, ny(2026, 11, 24, 10), ("interactive", "schedule")),
        (None, 0, ny(2026, 11, 28, 12), ("bulk", "default")),
    ],
)
def test_precedence_is_override_then_load_then_schedule_then_default(
    override: str | None, depth: float, at: datetime.datetime, expected: tuple[str, str]
) -> None:
    fields: dict[str, object] = {"schedule": market_hours(), "load": queue_rule()}
    if override:
        fields["override"] = {"profile": override}
    decision = decisions.decide(make_spec(**fields), at, busy(depth), decisions.Memory())
    assert (decision.profile, decision.source) == expected


def test_first_holding_rule_wins() -> None:
    load = {
        "rules": [
            {"profile": "bulk", "metric": "requestRate", "above": 1000},
            {"profile": "interactive", "metric": "queueDepth", "above": 10},
        ]
    }
    spec = make_spec(load=load)
    signals = decisions.Signals(metrics={"requestRate": 2000, "queueDepth": 50})
    decision = decisions.decide(spec, utc(2026, 11, 24), signals, decisions.Memory())
    assert decision.profile == "bulk"
    assert "load rule #1" in decision.reason


def test_autotune_replaces_the_delay_within_the_slo_bounds() -> None:
    slo = {
        "p95LatencyMs": 50,
        "autotune": True,
        "profiles": ["interactive"],
        "minQueueDelayMicroseconds": 100,
        "maxQueueDelayMicroseconds": 5000,
    }
    spec = make_spec(schedule=market_hours(), slo=slo)
    at = ny(2026, 11, 24, 10)
    for recommended, applied in [(1500, 1500), (20, 100), (90_000, 5000)]:
        signals = decisions.Signals(metrics={decisions.RECOMMENDED_QUEUE_DELAY: recommended})
        decision = decisions.decide(spec, at, signals, decisions.Memory())
        assert decision.settings.dynamic_batching["max_queue_delay_microseconds"] == applied
    # The bulk profile is not governed by the objective and keeps its own delay.
    signals = decisions.Signals(metrics={decisions.RECOMMENDED_QUEUE_DELAY: 1500})
    night = decisions.decide(spec, ny(2026, 11, 24, 20), signals, decisions.Memory())
    assert night.settings.dynamic_batching["max_queue_delay_microseconds"] == 50000


AUTOTUNED = {
    "p95LatencyMs": 50,
    "autotune": True,
    "profiles": ["interactive"],
    "minQueueDelayMicroseconds": 100,
    "maxQueueDelayMicroseconds": 20_000,
}


def recommended_delay(delay: float) -> decisions.Signals:
    return decisions.Signals(metrics={decisions.RECOMMENDED_QUEUE_DELAY: delay})


def delays(made: list[decisions.Decision]) -> list[int]:
    return [d.settings.dynamic_batching["max_queue_delay_microseconds"] for d in made]


def test_autotune_keeps_the_delay_while_recommendations_wobble() -> None:
    spec = make_spec(schedule=market_hours(), slo=AUTOTUNED)
    start = ny(2026, 11, 24, 10)
    wobbling = [10_000, 11_000, 9_000, 12_400, 7_600, 10_900]
    made = run(spec, [(start + i * SECOND, recommended_delay(r)) for i, r in enumerate(wobbling)])
    assert delays(made) == [10_000] * len(wobbling)
    assert made[-1].memory.tuned_delay_microseconds == 10_000


def test_autotune_follows_a_recommendation_that_moves_by_more_than_a_quarter() -> None:
    spec = make_spec(schedule=market_hours(), slo=AUTOTUNED)
    start = ny(2026, 11, 24, 10)
    moving = [10_000, 12_600, 12_000, 7_000, 60_000]
    made = run(spec, [(start + i * SECOND, recommended_delay(r)) for i, r in enumerate(moving)])
    # 12,600 is 26% above 10,000; 12,000 is close to it; 7,000 is 44% below; 60,000 is clamped.
    assert delays(made) == [10_000, 12_600, 12_600, 7_000, 20_000]


def test_autotune_does_not_flap_between_delays_near_zero() -> None:
    spec = make_spec(schedule=market_hours(), slo={**AUTOTUNED, "minQueueDelayMicroseconds": 0})
    start = ny(2026, 11, 24, 10)
    tiny = [0, 150, 30, 180, 500]
    made = run(spec, [(start + i * SECOND, recommended_delay(r)) for i, r in enumerate(tiny)])
    assert delays(made) == [0, 0, 0, 0, 500]


def test_autotune_keeps_its_delay_through_a_missing_recommendation() -> None:
    spec = make_spec(schedule=market_hours(), slo=AUTOTUNED)
    start = ny(2026, 11, 24, 10)
    ticks = [(start, recommended_delay(8_000)), (start + SECOND, QUIET)]
    assert delays(run(spec, ticks)) == [8_000, 8_000]


def test_a_profile_switch_starts_autotune_afresh() -> None:
    spec = make_spec(schedule=market_hours(), slo={**AUTOTUNED, "profiles": []})
    before_close = ny(2026, 11, 24, 15, 59, 59)
    after_close = ny(2026, 11, 24, 16)
    made = run(
        spec, [(before_close, recommended_delay(10_000)), (after_close, recommended_delay(11_000))]
    )
    assert [d.profile for d in made] == ["interactive", "bulk"]
    assert delays(made) == [10_000, 11_000]
    # Without a recommendation after the switch, the new profile's own delay applies.
    made = run(spec, [(before_close, recommended_delay(10_000)), (after_close, QUIET)])
    assert delays(made) == [10_000, 50_000]
    assert made[-1].memory.tuned_delay_microseconds is None


def test_a_profile_outside_the_objective_keeps_no_tuned_delay() -> None:
    spec = make_spec(schedule=market_hours(), slo=AUTOTUNED)
    decision = decisions.decide(
        spec, ny(2026, 11, 24, 20), recommended_delay(9_000), decisions.Memory()
    )
    assert decision.memory.tuned_delay_microseconds is None


def test_naive_time_is_refused() -> None:
    with pytest.raises(ValueError, match="aware datetime"):
        decisions.decide(make_spec(), datetime.datetime(2026, 11, 24), QUIET, decisions.Memory())
