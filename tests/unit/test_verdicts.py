"""The canary verdict, on recorded figures: readings every 5 s of a canary and its baseline."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence

import pytest

from batchpilot.policy import verdicts as canaries
from batchpilot.policy.verdicts import Served

START = datetime.datetime(2026, 11, 24, 15, tzinfo=datetime.UTC)
STEP = datetime.timedelta(seconds=5)
LIMITS = canaries.Limits(
    analysis=datetime.timedelta(seconds=60),
    min_requests=100,
    max_failure_rate=0.01,
    max_p95_ratio=1.5,
    max_p99_ratio=2.0,
)


def readings(
    canary_p95: Sequence[float | None],
    baseline_p95: float = 20.0,
    *,
    requests: float = 50.0,
    canary_failures: float = 0.0,
) -> list[canaries.Sample]:
    """One reading per canary p95, 5 s apart; the baseline serves three times the canary's
    requests (three replicas against one)."""
    return [
        canaries.Sample(
            at=START + (index + 1) * STEP,
            canary=Served(
                requests=requests,
                failures=canary_failures,
                p95_ms=p95,
                p99_ms=None if p95 is None else 1.4 * p95,
            ),
            baseline=Served(requests=3 * requests, p95_ms=baseline_p95, p99_ms=1.4 * baseline_p95),
        )
        for index, p95 in enumerate(canary_p95)
    ]


def judge(samples: list[canaries.Sample]) -> canaries.Judgement:
    return canaries.judge(samples, LIMITS, START, samples[-1].at if samples else START)


def test_a_canary_serving_like_the_rest_is_promoted_at_the_end_of_the_window() -> None:
    noisy = [21.0, 19.5, 22.0, 20.4, 18.9, 23.1, 20.0, 21.7, 19.8, 20.6, 22.4, 20.1]
    assert judge(readings(noisy[:11])).verdict is None, "55 s of a 60 s window: still analysing"
    promoted = judge(readings(noisy))
    assert promoted.verdict == "Promote"
    assert promoted.figures.ratios["p95_ms"] == pytest.approx(1.03, abs=0.02)


def test_one_slow_second_does_not_fail_a_canary() -> None:
    spiked = [20.0] * 5 + [400.0] + [20.5] * 6
    assert judge(readings(spiked)).verdict == "Promote"


def test_slow_readings_in_most_of_the_window_fail_it() -> None:
    slow = [20.0, 45.0, 50.0, 21.0, 48.0, 52.0, 47.0, 20.0, 49.0, 51.0, 46.0, 50.0]
    judged = judge(readings(slow))
    assert judged.verdict == "Rollback"
    assert judged.reason.startswith("p95 2.")
    assert "(limit 1.5x)" in judged.reason


def test_failures_past_the_limit_roll_back_as_soon_as_enough_requests_were_seen() -> None:
    failing = readings([20.0] * 3, canary_failures=5.0)  # 10% of 150 requests
    judged = judge(failing)
    assert judged.verdict == "Rollback", "15 s into a 60 s window: no need to wait"
    assert judged.reason == (
        "failure rate 10.00% against the baseline's 0.00%: more than 1 points above it"
    )
    assert judge(failing[:1]).verdict is None, "50 requests of the 100 needed: not yet"


def test_failures_the_baseline_has_too_are_not_the_canary_s() -> None:
    both = [
        canaries.Sample(
            at=START + (index + 1) * STEP,
            canary=Served(requests=50, failures=2, p95_ms=20.0),
            baseline=Served(requests=150, failures=6, p95_ms=20.0),
        )
        for index in range(12)
    ]
    assert judge(both).verdict == "Promote"


def test_too_little_traffic_is_inconclusive_and_says_which_side() -> None:
    quiet = judge(readings([20.0] * 12, requests=5.0))
    assert quiet.verdict == "Inconclusive"
    assert quiet.reason == "the canary served 60 requests of the 100 needed"


def test_no_baseline_replica_is_inconclusive() -> None:
    alone = [
        canaries.Sample(
            at=START + (index + 1) * STEP,
            canary=Served(requests=50, p95_ms=20.0),
            baseline=Served(),
        )
        for index in range(12)
    ]
    judged = judge(alone)
    assert judged.verdict == "Inconclusive"
    assert judged.reason == "the baseline served 0 requests of the 100 needed"


def test_without_enough_quantiles_on_both_sides_it_is_inconclusive() -> None:
    sparse = readings([20.0, None, None, 21.0] + [None] * 8)
    judged = judge(sparse)
    assert judged.verdict == "Inconclusive"
    assert "p95 on both sides" in judged.reason


def test_an_llm_canary_is_judged_by_its_inter_token_latency_too() -> None:
    limits = canaries.Limits(
        analysis=datetime.timedelta(seconds=60),
        min_requests=20,
        max_failure_rate=0.01,
        max_p95_ratio=3.0,
        max_inter_token_p95_ratio=1.3,
    )
    samples = [
        canaries.Sample(
            at=START + (index + 1) * STEP,
            canary=Served(requests=10, p95_ms=900.0, inter_token_p95_ms=62.0 + index % 3),
            baseline=Served(requests=30, p95_ms=850.0, inter_token_p95_ms=31.0 + index % 2),
        )
        for index in range(12)
    ]
    judged = canaries.judge(samples, limits, START, samples[-1].at)
    assert judged.verdict == "Rollback"
    assert judged.reason.startswith("inter-token p95 2.0")
    assert "p95_ms" in judged.figures.ratios
    assert "p99_ms" not in judged.figures.ratios


def test_the_figures_describe_the_window_in_one_line() -> None:
    described = judge(readings([30.0] * 12)).figures.describe()
    assert described == (
        "canary 600 requests, 0.00% failed; baseline 1800, 0.00% failed; p95 1.50x; p99 1.50x"
    )


def test_a_switch_without_objectives_is_judged_by_its_failures_alone() -> None:
    """A switch into bulk: 3x interactive's p95 is what bulk is for; nothing predicts bulk's."""
    slower = readings([60.0] * 12)
    judged = canaries.judge(slower, LIMITS, START, slower[-1].at, canaries.Objectives())
    assert judged.verdict == "Promote"
    assert judged.figures.ratios == {}
    assert "latency not judged" in judged.reason
    assert judge(slower).verdict == "Rollback", "as an edit, the same figures fail"


def test_a_switch_is_held_to_its_own_objective() -> None:
    objectives = canaries.Objectives(p95_ms=40.0)
    within = readings([55.0] * 12)  # 1.38x of 40 ms: within maxP95Ratio
    judged = canaries.judge(within, LIMITS, START, within[-1].at, objectives)
    assert judged.verdict == "Promote"
    assert judged.figures.describe().endswith("p95 1.38x of the objective")
    past = readings([80.0] * 12)
    judged = canaries.judge(past, LIMITS, START, past[-1].at, objectives)
    assert (judged.verdict, judged.reason) == ("Rollback", "p95 2.00x its objective (limit 1.5x)")
    sparse = readings([80.0, None, None] + [None] * 9)
    judged = canaries.judge(sparse, LIMITS, START, sparse[-1].at, objectives)
    assert judged.verdict == "Inconclusive"


def test_a_switch_still_fails_on_failures_the_baseline_does_not_have() -> None:
    failing = readings([60.0] * 3, canary_failures=5.0)
    judged = canaries.judge(failing, LIMITS, START, failing[-1].at, canaries.Objectives())
    assert judged.verdict == "Rollback"
    assert judged.reason.startswith("failure rate 10.00%")


def shares(canary_requests: float, *, count: int = 12) -> list[canaries.Sample]:
    """One canary replica and three baseline replicas serving 50 requests each per reading."""
    return [
        canaries.Sample(
            at=START + (index + 1) * STEP,
            canary=Served(requests=canary_requests, replicas=1, p95_ms=20.0),
            baseline=Served(requests=150.0, replicas=3, p95_ms=20.0),
        )
        for index in range(count)
    ]


def test_arrivals_a_canary_never_counted_are_failures() -> None:
    """Triton counts no request its full queue refused: the canary's count falls short of its
    share of the arrivals, and the shortfall is what its clients saw fail."""
    judged = judge(shares(10.0, count=3))
    assert judged.verdict == "Rollback", "120 requests refused of 150: no need to wait"
    assert judged.figures.canary_refused == 120.0
    assert judged.figures.canary_requests == 150.0
    assert judged.reason.startswith("failure rate 80.00%, 120 of them refused before Triton")


def test_a_share_within_the_balancing_tolerance_refuses_nothing() -> None:
    judged = judge(shares(40.0))  # 80% of its share
    assert judged.verdict == "Promote"
    assert judged.figures.canary_refused == 0.0
    unknown = [
        canaries.Sample(at=s.at, canary=Served(requests=10.0, p95_ms=20.0), baseline=s.baseline)
        for s in shares(10.0)
    ]
    assert judge(unknown).figures.canary_refused == 0.0, "no replica count: no share judged"


def test_a_shortfall_chance_explains_at_small_counts_refuses_nothing() -> None:
    """Arrivals spread at random: over one reading a share of 50 varies by about 7, so 30
    counted is chance (20 short, under three square roots of the share); the same 60% over
    twelve readings (240 short of 600) is not."""
    one = judge(shares(30.0, count=1))
    assert one.figures.canary_refused == 0.0, one.reason
    twelve = judge(shares(30.0, count=12))
    assert twelve.figures.canary_refused == pytest.approx(240.0)
    assert twelve.verdict == "Rollback"


def test_arrivals_a_canary_still_holds_in_its_queue_are_not_refused() -> None:
    """A canary with a long queue delay and batches that never fill has counted few of its
    arrivals when read: the rest wait in its queue (Triton's pending gauge), to be counted when
    they end. They are not refused, so the verdict is its latency's, not a failure rate."""
    holding = [
        dataclasses.replace(
            sample,
            canary=dataclasses.replace(sample.canary, pending=100.0, p95_ms=2000.0),
            baseline=dataclasses.replace(sample.baseline, pending=3.0),
        )
        for sample in shares(30.0)  # 60% of its share counted
    ]
    judged = judge(holding)
    assert judged.figures.canary_refused == 0.0
    assert judged.verdict == "Rollback"
    assert judged.reason.startswith("p95 100.00x the baseline's")
    emptied = [
        dataclasses.replace(sample, canary=dataclasses.replace(sample.canary, pending=0.0))
        for sample in holding
    ]
    refused = judge(emptied)
    assert refused.figures.canary_refused == pytest.approx(241.0), "none held: it was refused"
    assert refused.reason.startswith("failure rate")


def test_a_queue_that_releases_held_batches_is_not_refusing_between_them() -> None:
    """A long delay releases the canary's requests a batch at a time: a reading just after a
    batch left finds its queue empty while its pro-rated count lags by that batch (an e2e canary
    of a 3.5-s delay was rolled back for refusing 26 requests nobody saw fail). The most the
    queue held at a settled reading counts as arrived."""
    sawtooth = [
        dataclasses.replace(
            sample,
            canary=dataclasses.replace(sample.canary, pending=pending, p95_ms=3000.0),
        )
        for sample, pending in zip(shares(20.0, count=3), (45.0, 90.0, 0.0), strict=True)
    ]
    judged = judge(sawtooth)
    assert judged.figures.canary_refused == 0.0, judged.reason
    assert judged.verdict is None, "three readings of a 60-s window: still analysing"
    never_held = [
        dataclasses.replace(sample, canary=dataclasses.replace(sample.canary, pending=0.0))
        for sample in sawtooth
    ]
    assert judge(never_held).figures.canary_refused == pytest.approx(90.0)


def test_readings_that_reach_back_into_the_reload_judge_no_share() -> None:
    """Right after the canary's reload its requests stalled: its first readings count less than
    its share without refusing anything (a good change was rolled back on them)."""
    samples = shares(50.0)
    samples[:4] = [
        dataclasses.replace(sample, canary=Served(requests=0.0, replicas=1), settled=False)
        for sample in samples[:4]
    ]
    judged = judge(samples)
    assert judged.figures.canary_refused == 0.0
    assert judged.verdict == "Promote"


def test_an_llm_switch_to_more_sequences_is_held_to_its_inter_token_objective() -> None:
    """A bulk with a larger maxNumSeqs doubles the inter-token p95 on purpose: against the
    replicas still on interactive it fails; against bulk's own objective (itlP95Ms) it passes,
    and with no objective it is not judged by latency."""
    limits = canaries.Limits(
        analysis=datetime.timedelta(seconds=60),
        min_requests=20,
        max_failure_rate=0.01,
        max_p95_ratio=1.5,
        max_inter_token_p95_ratio=1.3,
    )
    samples = [
        canaries.Sample(
            at=START + (index + 1) * STEP,
            canary=Served(requests=10, p95_ms=1800.0, inter_token_p95_ms=62.0 + index % 3),
            baseline=Served(requests=30, p95_ms=900.0, inter_token_p95_ms=31.0 + index % 2),
        )
        for index in range(12)
    ]
    end = samples[-1].at
    assert canaries.judge(samples, limits, START, end).verdict == "Rollback"
    objective = canaries.Objectives(inter_token_p95_ms=80.0)
    judged = canaries.judge(samples, limits, START, end, objective)
    assert judged.verdict == "Promote"
    assert judged.figures.ratios == {"inter_token_p95_ms": pytest.approx(0.79, abs=0.01)}
    assert canaries.judge(samples, limits, START, end, canaries.Objectives()).verdict == "Promote"
