"""Recommendations: the batch a load makes, the delay that meets an objective, the knee."""

from __future__ import annotations

import pytest

from batchpilot_sidecar import recommending, steptimes

STEP = steptimes.StepTimeModel(t0_ms=4.0, c_ms=0.35, alpha=0.7)


def test_an_idle_model_makes_batches_of_one() -> None:
    batch = recommending.expected_batch(STEP, rate_per_second=0, delay_seconds=0.02, max_batch=128)
    assert batch == 1.0


def test_the_expected_batch_collects_what_arrives_while_waiting_and_running() -> None:
    rate, delay = 400.0, 0.02
    batch = recommending.expected_batch(
        STEP, rate_per_second=rate, delay_seconds=delay, max_batch=128
    )
    assert batch == pytest.approx(rate * (delay + STEP.ms(batch) / 1000), rel=1e-6)
    assert 10 < batch < 12


def test_a_device_that_cannot_keep_up_runs_full_batches() -> None:
    linear = steptimes.StepTimeModel(t0_ms=1.0, c_ms=2.0, alpha=1.0)
    batch = recommending.expected_batch(
        linear, rate_per_second=1000, delay_seconds=0.0, max_batch=64
    )
    assert batch == 64


def test_the_recommended_delay_spends_the_objective_exactly() -> None:
    objective = recommending.Objective(p95_ms=40, margin_ms=5, max_delay_us=100_000)
    found = recommending.queue_delay(STEP, objective, rate_per_second=200, max_batch=128)
    assert found.meets_objective
    spent = found.delay_us / 1000 + found.step_ms + found.margin_ms
    assert spent == pytest.approx(40, abs=0.01)
    assert found.expected_batch == pytest.approx(
        200 * (found.delay_us / 1e6 + found.step_ms / 1000), rel=1e-3
    )
    assert "within [0, 100000] us" in found.reason


def test_more_load_means_bigger_batches_and_a_shorter_delay() -> None:
    objective = recommending.Objective(p95_ms=40, margin_ms=5)
    delays = [
        recommending.queue_delay(STEP, objective, rate_per_second=rate, max_batch=128).delay_us
        for rate in (10, 200, 1000, 3000)
    ]
    assert delays == sorted(delays, reverse=True)
    assert len(set(delays)) == 4


def test_a_generous_objective_is_capped_at_the_highest_allowed_delay() -> None:
    objective = recommending.Objective(p95_ms=500, max_delay_us=20_000)
    found = recommending.queue_delay(STEP, objective, rate_per_second=100, max_batch=128)
    assert found.delay_us == 20_000
    assert found.meets_objective
    assert "capped at the highest allowed delay" in found.reason


def test_an_objective_shorter_than_a_step_gets_the_lowest_delay_and_says_so() -> None:
    objective = recommending.Objective(p95_ms=4, min_delay_us=100, max_delay_us=20_000)
    found = recommending.queue_delay(STEP, objective, rate_per_second=100, max_batch=128)
    assert found.delay_us == 100
    assert not found.meets_objective
    assert "cannot be met" in found.reason


def test_the_default_margin_is_a_tenth_of_the_objective_and_at_least_a_millisecond() -> None:
    assert recommending.Objective(p95_ms=50).effective_margin_ms == 5
    assert recommending.Objective(p95_ms=5).effective_margin_ms == 1
    assert recommending.Objective(p95_ms=50, margin_ms=0).effective_margin_ms == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"p95_ms": 0}, "must be positive"),
        ({"p95_ms": 10, "margin_ms": -1}, "must not be negative"),
        ({"p95_ms": 10, "min_delay_us": 500, "max_delay_us": 100}, "delay bounds"),
    ],
)
def test_objectives_that_make_no_sense_are_refused(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        recommending.Objective(**fields)  # type: ignore[arg-type]


def test_preferred_batch_is_the_knee_rounded_to_a_power_of_two() -> None:
    preferred = recommending.preferred_batch(STEP, max_batch=128)
    assert preferred.knee == pytest.approx(32.5, abs=0.1)
    assert preferred.size == 32


def test_preferred_batch_is_capped_by_max_batch_size_and_by_memory() -> None:
    assert recommending.preferred_batch(STEP, max_batch=16).size == 16
    capped = recommending.preferred_batch(STEP, max_batch=128, memory_cap=20)
    assert capped.size == 20
    assert "free GPU memory" in capped.reason


def test_a_flat_step_time_prefers_the_largest_batch() -> None:
    flat = steptimes.StepTimeModel(t0_ms=5.0, c_ms=0.0, alpha=1.0)
    preferred = recommending.preferred_batch(flat, max_batch=64)
    assert (preferred.size, preferred.knee) == (64, None)


def test_memory_cap_leaves_headroom_and_never_goes_below_one() -> None:
    assert recommending.memory_cap(free_bytes=10e9, bytes_per_item=100e6) == 90
    assert recommending.memory_cap(free_bytes=1e6, bytes_per_item=100e6) == 1
