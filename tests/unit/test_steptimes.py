"""The step-time fit: parameters recovered from noisy data, outliers discounted, gaps named."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot_sidecar import steptimes

TRUTH = steptimes.StepTimeModel(t0_ms=4.0, c_ms=0.35, alpha=0.7)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def observed(
    sizes: tuple[int, ...] = SIZES,
    *,
    truth: steptimes.StepTimeModel = TRUTH,
    noise: float = 0.01,
    intervals: int = 8,
    seed: int = 0,
) -> list[steptimes.Observation]:
    """Per-interval means of a few executions each, with relative Gaussian noise."""
    generator = np.random.default_rng(seed)
    found = []
    for size in sizes:
        for _ in range(intervals):
            executions = int(generator.integers(1, 30))
            jitter = generator.normal(0.0, noise / np.sqrt(executions))
            mean = truth.ms(size) * (1.0 + jitter)
            found.append(
                steptimes.Observation(batch_size=size, executions=executions, mean_ms=mean)
            )
    return found


def assert_close(
    model: steptimes.StepTimeModel, truth: steptimes.StepTimeModel, rel: float
) -> None:
    assert model.t0_ms == pytest.approx(truth.t0_ms, rel=rel)
    assert model.c_ms == pytest.approx(truth.c_ms, rel=rel)
    assert model.alpha == pytest.approx(truth.alpha, rel=rel)


def test_noiseless_points_give_the_parameters_back_exactly() -> None:
    result = steptimes.fit(observed(noise=0.0))
    assert isinstance(result, steptimes.Fit)
    assert_close(result.model, TRUTH, rel=1e-3)
    assert result.r_squared == pytest.approx(1.0)
    assert result.rmse_ms < 1e-3
    assert result.outliers == ()


@pytest.mark.parametrize("seed", range(5))
def test_noisy_points_recover_the_parameters_within_five_percent(seed: int) -> None:
    result = steptimes.fit(observed(noise=0.02, seed=seed))
    assert isinstance(result, steptimes.Fit)
    assert_close(result.model, TRUTH, rel=0.05)
    assert result.r_squared > 0.99
    assert result.batch_sizes == SIZES
    assert result.span == 128


def test_contended_intervals_and_a_cold_start_do_not_move_the_fit() -> None:
    clean = observed(noise=0.01)
    # Executions that waited for a device other instances held, in a third of the intervals
    # of some sizes, and a first execution that paid for warming up.
    contended = [
        steptimes.Observation(
            batch_size=o.batch_size, executions=o.executions, mean_ms=o.mean_ms * 2.5
        )
        for o in clean[::3]
        if o.batch_size in (2, 8, 32)
    ]
    cold = [steptimes.Observation(batch_size=1, executions=1, mean_ms=40.0)]
    result = steptimes.fit([*clean, *contended, *cold])
    assert isinstance(result, steptimes.Fit)
    assert_close(result.model, TRUTH, rel=0.05)


def test_a_batch_size_that_is_off_altogether_is_named_an_outlier() -> None:
    points = [o for o in observed(noise=0.005) if o.batch_size != 16]
    points.append(steptimes.Observation(batch_size=16, executions=50, mean_ms=30.0))
    result = steptimes.fit(points)
    assert isinstance(result, steptimes.Fit)
    assert result.outliers == (16,)
    assert_close(result.model, TRUTH, rel=0.05)
    # R^2 weighs the points as the fit does, so the right curve reads as right (unweighted by
    # the fit it was 0.20); the RMSE, over every point, still shows how far off 16 is.
    assert result.r_squared > 0.99
    assert result.rmse_ms > 5.0


def test_a_linear_step_with_no_fixed_cost_is_fitted_on_the_boundary() -> None:
    truth = steptimes.StepTimeModel(t0_ms=0.0, c_ms=0.5, alpha=1.0)
    result = steptimes.fit(observed(truth=truth, noise=0.0))
    assert isinstance(result, steptimes.Fit)
    assert result.model.t0_ms == pytest.approx(0.0, abs=1e-6)
    assert result.model.c_ms == pytest.approx(0.5, rel=1e-3)
    assert result.model.alpha == pytest.approx(1.0, rel=1e-3)


def test_a_flat_step_time_has_no_knee() -> None:
    points = [
        steptimes.Observation(batch_size=size, executions=10, mean_ms=5.0 + 0.01 * (-1) ** size)
        for size in SIZES
    ]
    result = steptimes.fit(points)
    assert isinstance(result, steptimes.Fit)
    assert result.model.c_ms == pytest.approx(0.0, abs=0.01)
    assert result.model.t0_ms == pytest.approx(5.0, abs=0.05)


def test_knee_is_where_the_growing_part_equals_the_fixed_part() -> None:
    knee = TRUTH.knee()
    assert knee is not None
    assert TRUTH.c_ms * knee**TRUTH.alpha == pytest.approx(TRUTH.t0_ms)
    assert steptimes.StepTimeModel(t0_ms=5.0, c_ms=0.0, alpha=1.0).knee() is None


def test_too_few_batch_sizes_says_which_were_seen() -> None:
    result = steptimes.fit(observed((1, 2, 8)))
    assert isinstance(result, steptimes.NotEnoughData)
    assert result.batch_sizes == (1, 2, 8)
    assert "3 distinct batch sizes" in result.reason
    assert "(1, 2, 8)" in result.reason


def test_sizes_seen_only_once_or_twice_do_not_count() -> None:
    points = [
        *observed((1, 2, 4)),
        steptimes.Observation(batch_size=64, executions=2, mean_ms=TRUTH.ms(64)),
    ]
    result = steptimes.fit(points)
    assert isinstance(result, steptimes.NotEnoughData)
    assert result.batch_sizes == (1, 2, 4)


def test_a_narrow_span_of_batch_sizes_is_not_enough() -> None:
    result = steptimes.fit(observed((8, 10, 12, 16, 20)))
    assert isinstance(result, steptimes.NotEnoughData)
    assert "span 2.5x" in result.reason


def test_no_observations_at_all() -> None:
    result = steptimes.fit([])
    assert isinstance(result, steptimes.NotEnoughData)
    assert result.batch_sizes == ()
    assert result.reason.startswith("0 distinct batch sizes")
