"""The LLM step-time fit: an engine's inter-token latency against the sequences its steps ran
(from its step counts, or by Little's law where it has none), per span of at least two seconds
of collection intervals, capped at the engine's limit, fitted by the classic step-time fit;
gaps named instead of guessed."""

from __future__ import annotations

import numpy as np
import pytest

from batchpilot_sidecar import decodesteps, steptimes
from batchpilot_triton.engine_metrics import EngineCounts, Histogram

TRUTH = steptimes.StepTimeModel(t0_ms=3.0, c_ms=0.4, alpha=0.8)
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def samples(
    running_counts: tuple[int, ...] = COUNTS,
    *,
    noise: float = 0.01,
    intervals: int = 6,
    seed: int = 0,
) -> list[decodesteps.Sample]:
    """Intervals at each running count, the mean gauge reading a little off the whole count
    and the mean gap noisy."""
    generator = np.random.default_rng(seed)
    found = []
    for running in running_counts:
        for _ in range(intervals):
            tokens = int(generator.integers(20, 400))
            mean = TRUTH.ms(running) * (1.0 + generator.normal(0.0, noise))
            wobble = float(generator.uniform(-0.3, 0.3))
            found.append(decodesteps.Sample(running=running + wobble, tokens=tokens, mean_ms=mean))
    return found


def gaps(count: float, seconds: float) -> EngineCounts:
    """An interval of an engine that does not count its steps: `count` gaps between tokens,
    `seconds` in all."""
    return EngineCounts(inter_token=Histogram({float("inf"): count}, count, seconds))


def stepped(*, steps: float, running: float, step_ms: float) -> EngineCounts:
    """An interval of an engine that counts its steps (`vllm:iteration_tokens_total`): `steps`
    steps of `step_ms`, each giving a token to `running` sequences."""
    tokens = steps * running
    return EngineCounts(
        inter_token=Histogram({float("inf"): tokens}, tokens, tokens * step_ms / 1000),
        iteration_tokens=Histogram({float("inf"): steps}, steps, tokens),
        generation_tokens=tokens,
    )


def test_an_interval_pairs_the_mean_gap_with_the_tokens_a_step_generated() -> None:
    # 25 steps of 6 ms, 8 sequences each: 200 gaps of 6 ms, 8 tokens a step.
    found = decodesteps.sample(stepped(steps=25, running=8, step_ms=6.0), seconds=0.15)
    assert found == decodesteps.Sample(
        running=pytest.approx(8.0), tokens=200, mean_ms=pytest.approx(6.0)
    )


def test_without_step_counts_the_running_sequences_are_the_gaps_time_over_the_span() -> None:
    # 200 gaps of 6 ms in 0.15 s: 1.2 s of gaps, so 8 sequences ran on average (Little's law).
    found = decodesteps.sample(gaps(200, 1.2), seconds=0.15)
    assert found == decodesteps.Sample(
        running=pytest.approx(8.0), tokens=200, mean_ms=pytest.approx(6.0)
    )


def test_an_interval_without_gaps_is_no_sample() -> None:
    assert decodesteps.sample(EngineCounts(), seconds=1.0) is None
    assert decodesteps.sample(gaps(2.0, 0.01), seconds=0.0) is None


def test_a_pool_gives_one_sample_per_two_seconds_of_intervals_with_their_gaps_summed() -> None:
    pool = decodesteps.Pool()
    # Half-second intervals, one idle: 800 gaps, 6 s of them, in 2 s.
    intervals = [gaps(400, 2.0), gaps(300, 3.0), EngineCounts(), gaps(100, 1.0)]
    found = [pool.add(interval, seconds=0.5) for interval in intervals]
    assert found[:3] == [None, None, None]
    assert found[3] == decodesteps.Sample(
        running=pytest.approx(3.0), tokens=800, mean_ms=pytest.approx(7.5)
    )
    # It starts over: the next sample takes the next two seconds only.
    assert [pool.add(gaps(200, 2.0), seconds=1.0) for _ in range(2)] == [
        None,
        decodesteps.Sample(running=pytest.approx(2.0), tokens=400, mean_ms=pytest.approx(10.0)),
    ]


def test_an_interval_as_long_as_the_span_is_a_sample_of_its_own() -> None:
    pool = decodesteps.Pool()
    found = pool.add(gaps(1000, 15.0), seconds=decodesteps.SAMPLE_SECONDS + 1.0)
    assert found == decodesteps.Sample(running=5.0, tokens=1000, mean_ms=15.0)


def test_two_idle_seconds_are_no_sample_and_do_not_dilute_the_next() -> None:
    pool = decodesteps.Pool()
    assert [pool.add(EngineCounts(), seconds=0.5) for _ in range(4)] == [None] * 4
    found = [pool.add(gaps(400, 4.0), seconds=0.5) for _ in range(4)]
    assert found[3] == decodesteps.Sample(running=8.0, tokens=1600, mean_ms=10.0)


def test_statistics_that_arrive_in_a_bunch_read_as_the_sequences_that_ran() -> None:
    # 8 sequences at 10 ms a step for 2 s are 200 steps and 16 s of gaps; most of them reach
    # Triton at once. Counted steps say 8 whenever they land.
    counted = [stepped(steps=s, running=8, step_ms=10.0) for s in (12.5, 0, 12.5, 175)]
    assert decodesteps.sample(counted[-1], seconds=0.5) == decodesteps.Sample(
        running=pytest.approx(8.0), tokens=1400, mean_ms=pytest.approx(10.0)
    )
    # Without step counts the bunch alone reads 28; two seconds pooled even it out.
    bunched = [gaps(100, 1.0), EngineCounts(), gaps(100, 1.0), gaps(1400, 14.0)]
    assert decodesteps.sample(bunched[-1], seconds=0.5) == decodesteps.Sample(
        running=pytest.approx(28.0), tokens=1400, mean_ms=pytest.approx(10.0)
    )
    pool = decodesteps.Pool()
    (found,) = [s for s in (pool.add(interval, seconds=0.5) for interval in bunched) if s]
    assert found.running == pytest.approx(8.0)
    assert found.mean_ms == pytest.approx(10.0)


def test_a_burst_whose_statistics_land_after_it_reads_its_size_from_counted_steps() -> None:
    # 16 sequences for 4 s at 10 ms a step, then idle; every statistic lands in the last 0.5 s.
    pool = decodesteps.Pool()
    intervals = [EngineCounts()] * 7 + [stepped(steps=400, running=16, step_ms=10.0)]
    found = [s for s in (pool.add(interval, seconds=0.5) for interval in intervals) if s]
    assert found == [
        decodesteps.Sample(running=pytest.approx(16.0), tokens=6400, mean_ms=pytest.approx(10.0))
    ]


def test_the_running_count_is_clamped_to_the_engine_s_limit_when_it_is_known() -> None:
    # 94 sequences' worth of gaps in half a second, on an engine that runs at most 16.
    overshoot = gaps(4700, 47.0)
    assert decodesteps.sample(overshoot, seconds=0.5) == decodesteps.Sample(
        running=pytest.approx(94.0), tokens=4700, mean_ms=pytest.approx(10.0)
    )
    capped = decodesteps.sample(overshoot, seconds=0.5, max_running=16)
    assert capped == decodesteps.Sample(running=16, tokens=4700, mean_ms=pytest.approx(10.0))
    assert capped.as_observation().batch_size == 16
    # Below the limit it changes nothing.
    assert decodesteps.sample(gaps(400, 4.0), seconds=0.5, max_running=16) == (
        decodesteps.Sample(running=pytest.approx(8.0), tokens=400, mean_ms=pytest.approx(10.0))
    )


def test_a_pool_clamps_its_sample_to_the_limit_it_is_given() -> None:
    pool = decodesteps.Pool()
    found = [pool.add(gaps(4700, 47.0), seconds=1.0, max_running=16) for _ in range(2)]
    assert found == [None, decodesteps.Sample(running=16, tokens=9400, mean_ms=10.0)]


def test_a_token_means_a_running_sequence_however_low_the_readings() -> None:
    observation = decodesteps.Sample(running=0.2, tokens=30, mean_ms=3.0).as_observation()
    assert observation.batch_size == 1


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_recovers_t0_c_and_alpha_from_noisy_intervals(seed: int) -> None:
    result = decodesteps.fit(samples(seed=seed))
    assert isinstance(result, steptimes.Fit)
    assert result.model.t0_ms == pytest.approx(TRUTH.t0_ms, rel=0.15)
    assert result.model.c_ms == pytest.approx(TRUTH.c_ms, rel=0.15)
    assert result.model.alpha == pytest.approx(TRUTH.alpha, rel=0.1)
    assert result.batch_sizes == COUNTS
    for running in (1, 8, 64):
        assert result.model.ms(running) == pytest.approx(TRUTH.ms(running), rel=0.03)


def test_no_samples_say_nothing_was_seen() -> None:
    result = decodesteps.fit(())
    assert isinstance(result, steptimes.NotEnoughData)
    assert result.reason.startswith("0 distinct running-sequence counts")


def test_too_few_running_counts_are_named_instead_of_fitted() -> None:
    result = decodesteps.fit(samples((2, 4, 8)))
    assert isinstance(result, steptimes.NotEnoughData)
    assert result.reason == (
        "3 distinct running-sequence counts seen at least 16 times (2, 4, 8); "
        "a fit needs 4 spanning at least 4x"
    )


def test_running_counts_too_close_together_are_named_instead_of_fitted() -> None:
    result = decodesteps.fit(samples((4, 5, 6, 7)))
    assert isinstance(result, steptimes.NotEnoughData)
    assert "running-sequence counts seen span 1.8x (4, 5, 6, 7)" in result.reason


def test_a_count_with_few_tokens_behind_it_does_not_count_as_seen() -> None:
    sparse = [decodesteps.Sample(running=32, tokens=5, mean_ms=TRUTH.ms(32))]
    result = decodesteps.fit(samples((1, 2, 4)) + sparse)
    assert isinstance(result, steptimes.NotEnoughData)
    assert result.batch_sizes == (1, 2, 4)
