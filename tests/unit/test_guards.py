"""The SLO guard: a measured p95 above the objective halves the queue delay at once, no more
often than the guard interval allows, and the delay returns once the p95 has stayed within the
objective for that long."""

from __future__ import annotations

import datetime

from batchpilot.policy import decisions
from builders import make_spec, utc

START = utc(2026, 11, 24, 15)
SLO = {"p95LatencyMs": 50, "profiles": ["interactive"], "guardIntervalSeconds": 15}


def p95(value: float) -> decisions.Signals:
    return decisions.Signals(metrics={"p95LatencyMs": value})


def delays(readings: list[tuple[float, float]], **slo: object) -> list[tuple[int, str | None]]:
    """(queue delay, guard action) per decision, for readings of (seconds after start, p95)."""
    spec = make_spec(
        defaultProfile="interactive",
        profiles={
            "interactive": {"maxQueueDelayMicroseconds": 8000},
            "bulk": {"maxQueueDelayMicroseconds": 50000},
        },
        slo={**SLO, **slo},
    )
    memory = decisions.Memory()
    found = []
    for offset, latency in readings:
        now = START + datetime.timedelta(seconds=offset)
        decision = decisions.decide(spec, now, p95(latency), memory)
        memory = decision.memory
        delay = decision.settings.dynamic_batching["max_queue_delay_microseconds"]
        found.append((delay, decision.guard))
    return found


def test_a_breach_halves_the_delay_at_once() -> None:
    assert delays([(0, 40), (5, 80)]) == [(8000, None), (4000, "lowered")]


def test_a_lasting_breach_halves_again_only_after_the_interval() -> None:
    made = delays([(0, 80), (5, 80), (10, 80), (15, 80)])
    assert made == [(4000, "lowered"), (4000, None), (4000, None), (2000, "lowered")]


def test_the_guard_never_goes_below_the_objectives_lowest_delay() -> None:
    made = delays([(0, 80), (15, 80), (30, 80)], minQueueDelayMicroseconds=3000)
    assert [delay for delay, _ in made] == [4000, 3000, 3000]


def test_the_delay_returns_once_the_p95_stayed_within_the_objective_for_the_interval() -> None:
    made = delays([(0, 80), (5, 30), (10, 30), (20, 30), (21, 30)])
    assert made == [(4000, "lowered"), (4000, None), (4000, None), (8000, "restored"), (8000, None)]


def test_a_new_breach_starts_the_wait_for_the_return_afresh() -> None:
    made = delays([(0, 80), (5, 30), (12, 80), (22, 30), (30, 30), (37, 30)])
    assert [delay for delay, _ in made] == [4000, 4000, 4000, 4000, 4000, 8000]


def test_a_missing_p95_keeps_the_guard_as_it_was() -> None:
    spec = make_spec(
        defaultProfile="interactive",
        profiles={"interactive": {"maxQueueDelayMicroseconds": 8000}},
        slo=SLO,
    )
    lowered = decisions.decide(spec, START, p95(80), decisions.Memory())
    later = decisions.decide(
        spec, START + datetime.timedelta(seconds=60), decisions.Signals(), lowered.memory
    )
    assert later.settings.dynamic_batching["max_queue_delay_microseconds"] == 4000
    assert "no p95 reading" in later.reason


def test_the_guard_stays_out_of_profiles_the_objective_does_not_govern() -> None:
    spec = make_spec(slo=SLO)  # defaultProfile bulk; the objective governs interactive only
    decision = decisions.decide(spec, START, p95(500), decisions.Memory())
    assert decision.settings.dynamic_batching["max_queue_delay_microseconds"] == 50000
    assert decision.guard is None


def test_the_guard_can_be_turned_off() -> None:
    assert delays([(0, 80)], guard=False) == [(8000, None)]
