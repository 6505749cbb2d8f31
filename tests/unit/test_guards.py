"""The SLO guard: a p95 above the objective, measured under the queue delay in force, drops the
delay at once (to the sidecars' recommendation where that is lower, else to half), and the delay
returns once the p95 has stayed within the objective for the guard interval."""

from __future__ import annotations

import datetime

from batchpilot.policy import decisions
from builders import make_spec, utc

START = utc(2026, 11, 24, 15)
SLO = {"p95LatencyMs": 50, "profiles": ["interactive"], "guardIntervalSeconds": 15}


def reading(p95: float | None, recommended: float | None = None) -> decisions.Signals:
    metrics = {"p95LatencyMs": p95, decisions.RECOMMENDED_QUEUE_DELAY: recommended}
    return decisions.Signals(metrics={k: v for k, v in metrics.items() if v is not None})


def delays(
    readings: list[tuple[float, decisions.Signals]], **slo: object
) -> list[tuple[int, str | None]]:
    """(queue delay, guard action) per decision, for (seconds after start, signals)."""
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
    for offset, signals in readings:
        now = START + datetime.timedelta(seconds=offset)
        decision = decisions.decide(spec, now, signals, memory)
        memory = decision.memory
        delay = decision.settings.dynamic_batching["max_queue_delay_microseconds"]
        found.append((delay, decision.guard))
    return found


def p95s(*timeline: tuple[float, float]) -> list[tuple[float, decisions.Signals]]:
    return [(offset, reading(p95)) for offset, p95 in timeline]


def test_a_breach_measured_under_the_delay_in_force_halves_it_at_once() -> None:
    assert delays(p95s((0, 40), (15, 80))) == [(8000, None), (4000, "lowered")]


def test_a_breach_right_after_a_change_waits_until_the_change_was_measured() -> None:
    made = delays(p95s((0, 80), (10, 80), (15, 80)))
    assert made == [(8000, None), (8000, None), (4000, "lowered")]


def test_a_lasting_breach_halves_again_once_the_lower_delay_was_measured() -> None:
    made = delays(p95s((0, 40), (15, 80), (20, 80), (29, 80), (30, 80)))
    assert [delay for delay, _ in made] == [8000, 4000, 4000, 4000, 2000]


def test_the_guard_takes_a_lower_recommendation_rather_than_halving() -> None:
    made = delays([(0, reading(40)), (15, reading(80, recommended=1500))])
    assert made[-1] == (1500, "lowered")


def test_the_guard_never_goes_below_the_objectives_lowest_delay() -> None:
    made = delays(p95s((0, 40), (15, 80), (30, 80), (45, 80)), minQueueDelayMicroseconds=3000)
    assert [delay for delay, _ in made] == [8000, 4000, 3000, 3000]


def test_the_delay_returns_once_the_p95_stayed_within_the_objective_for_the_interval() -> None:
    made = delays(p95s((0, 40), (15, 80), (20, 30), (25, 30), (35, 30), (36, 30)))
    assert made == [
        (8000, None),
        (4000, "lowered"),
        (4000, None),
        (4000, None),
        (8000, "restored"),
        (8000, None),
    ]


def test_a_new_breach_starts_the_wait_for_the_return_afresh() -> None:
    made = delays(p95s((0, 40), (15, 80), (20, 30), (27, 80), (37, 30), (45, 30), (52, 30)))
    assert [delay for delay, _ in made] == [8000, 4000, 4000, 4000, 4000, 4000, 8000]


def test_a_missing_p95_keeps_the_guard_as_it_was() -> None:
    made = delays([(0, reading(40)), (15, reading(80)), (60, reading(None))])
    assert [delay for delay, _ in made] == [8000, 4000, 4000]


def test_the_guard_stays_out_of_profiles_the_objective_does_not_govern() -> None:
    spec = make_spec(slo=SLO)  # defaultProfile bulk; the objective governs interactive only
    memory = decisions.decide(spec, START, reading(500), decisions.Memory()).memory
    later = START + datetime.timedelta(seconds=30)
    decision = decisions.decide(spec, later, reading(500), memory)
    assert decision.settings.dynamic_batching["max_queue_delay_microseconds"] == 50000
    assert decision.guard is None


def test_the_guard_can_be_turned_off() -> None:
    assert delays(p95s((0, 40), (15, 80)), guard=False) == [(8000, None), (8000, None)]


def test_without_a_p95_objective_the_guard_does_nothing() -> None:
    made = delays(p95s((0, 400), (15, 800), (30, 800)), p95LatencyMs=None, itlP95Ms=40)
    assert made == [(8000, None), (8000, None), (8000, None)]
