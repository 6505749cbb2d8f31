"""The sidecar's collection loop against a scripted Triton: rates, step-time points, fits,
reloads, failures, and memory that stays bounded whatever Triton serves."""

from __future__ import annotations

import pytest

from batchpilot_sidecar import collecting, steptimes
from fake_triton import FakeModel, FakeTriton
from sidecar_builders import TRUTH, Clock, make_collector, one_gpu, tick


async def test_rates_and_step_time_points_come_from_the_increase_between_readings() -> None:
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    clock = Clock()
    collector = make_collector(triton, clock)
    await collector.collect()
    model.run(batch_size=4, executions=50, step_ms=5.2, queue_ms=2.0)
    model.pending = 3
    await tick(collector, clock)

    state = collector.models["gpu_sim"]
    rates = state.rates(clock.now)
    assert rates is not None
    assert rates.seconds == 1.0
    assert rates.request_rate == 200
    assert rates.counted.average_batch_size == 4
    assert rates.counted.compute_ms_per_request == pytest.approx(5.2)
    assert state.compute_ms_per_execution(clock.now) == pytest.approx(5.2)
    assert rates.counted.queue_ms_per_request == pytest.approx(2.0)
    assert rates.pending == 3
    assert [o for _, o in state.observations] == [
        steptimes.Observation(batch_size=4, executions=50, mean_ms=pytest.approx(5.2))  # type: ignore[arg-type]
    ]
    assert state.config is not None
    assert state.config.max_batch_size == 128
    assert collector.gpu.reason is not None
    assert "nvidia-ml-py" in collector.gpu.reason


async def test_the_rate_window_keeps_only_recent_intervals() -> None:
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    clock = Clock()
    collector = make_collector(triton, clock, rate_window=3.0)
    await collector.collect()
    for executions in (100, 10, 10, 10):
        model.run(batch_size=1, executions=executions, step_ms=4.4)
        await tick(collector, clock)
    rates = collector.models["gpu_sim"].rates(clock.now)
    assert rates is not None
    assert (rates.seconds, rates.counted.requests) == (3.0, 30)


async def test_the_fit_appears_once_enough_batch_sizes_were_seen() -> None:
    model = FakeModel("gpu_sim")
    collector_clock = Clock()
    collector = make_collector(FakeTriton(model), collector_clock, fit_every=1.0)
    await collector.collect()
    for size in (1, 2, 4):
        model.run(batch_size=size, executions=10, step_ms=TRUTH.ms(size))
        await tick(collector, collector_clock)
    state = collector.models["gpu_sim"]
    assert isinstance(state.step_time, steptimes.NotEnoughData)
    assert state.step_time.batch_sizes == (1, 2, 4)
    for size in (8, 16, 32, 64, 128):
        model.run(batch_size=size, executions=10, step_ms=TRUTH.ms(size))
        await tick(collector, collector_clock)
    fit = state.step_time
    assert isinstance(fit, steptimes.Fit)
    assert fit.model.t0_ms == pytest.approx(4.0, rel=0.01)
    assert fit.model.c_ms == pytest.approx(0.35, rel=0.01)
    assert fit.model.alpha == pytest.approx(0.7, rel=0.01)


async def test_old_observations_leave_the_fit_window() -> None:
    model = FakeModel("gpu_sim")
    clock = Clock()
    collector = make_collector(FakeTriton(model), clock, fit_window=5.0, fit_every=1.0)
    await collector.collect()
    for size in (1, 4, 16, 64):
        model.run(batch_size=size, executions=10, step_ms=TRUTH.ms(size))
        await tick(collector, clock)
    assert isinstance(collector.models["gpu_sim"].step_time, steptimes.Fit)
    for _ in range(6):
        await tick(collector, clock)
    state = collector.models["gpu_sim"]
    assert len(state.observations) == 0
    assert isinstance(state.step_time, steptimes.NotEnoughData)


async def test_a_reload_counts_from_zero_and_rereads_the_config() -> None:
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    clock = Clock()
    collector = make_collector(triton, clock)
    await collector.collect()
    model.run(batch_size=8, executions=40, step_ms=6.0)
    await tick(collector, clock)
    reads = triton.config_reads
    model.reload()
    model.queue_delay_us = 20_000
    model.run(batch_size=8, executions=5, step_ms=5.5)
    await tick(collector, clock)
    state = collector.models["gpu_sim"]
    assert [o.executions for _, o in state.observations] == [40, 5]
    assert state.observations[-1][1].mean_ms == pytest.approx(5.5)
    assert triton.config_reads == reads + 1
    assert state.config is not None
    assert state.config.max_queue_delay_us == 20_000


async def test_an_unreachable_triton_is_reported_and_nothing_is_invented() -> None:
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    clock = Clock()
    collector = make_collector(triton, clock, rate_window=3.0)
    await collector.collect()
    model.run(batch_size=2, executions=10, step_ms=5.0)
    await tick(collector, clock)
    triton.down = True
    for _ in range(4):
        await tick(collector, clock)
    health = collector.health[collecting.TRITON_METRICS]
    assert health.failures == 4
    assert health.last_error is not None
    assert "Connection refused" in health.last_error
    assert health.last_success == clock.now - 4
    assert collector.models["gpu_sim"].rates(clock.now) is None, "no rates without readings"
    triton.down = False
    await tick(collector, clock)
    assert collector.models["gpu_sim"].rates(clock.now) is None, "rates need two pages again"
    assert collector.health[collecting.TRITON_METRICS].last_error is None


async def test_only_the_models_asked_for_are_tracked() -> None:
    triton = FakeTriton(FakeModel("a"), FakeModel("b"), FakeModel("c"))
    clock = Clock()
    collector = make_collector(triton, clock, models=("a", "c"))
    await collector.collect()
    assert sorted(collector.models) == ["a", "c"]
    assert collector.untracked == 0


async def test_memory_is_bounded_whatever_triton_serves() -> None:
    served = [FakeModel(f"model_{i:03d}") for i in range(120)]
    triton = FakeTriton(*served)
    clock = Clock()
    collector = make_collector(triton, clock, max_models=20, max_observations=50, rate_window=5.0)
    await collector.collect()
    for round_ in range(15):
        for model in served:
            for size in range(1, 9):
                model.run(batch_size=size + round_ % 3, executions=1, step_ms=5.0)
        await tick(collector, clock)
    assert len(collector.models) == 20
    assert collector.untracked == 100
    for state in collector.models.values():
        assert len(state.observations) <= 50
        assert len(state.intervals) <= 7
        assert state.totals is not None
        assert len(state.totals) <= 10


async def test_a_busy_newcomer_takes_the_place_of_the_idlest_model() -> None:
    busy, idle = FakeModel("busy"), FakeModel("idle")
    triton = FakeTriton(busy, idle)
    clock = Clock()
    collector = make_collector(triton, clock, max_models=2)
    await collector.collect()
    busy.run(batch_size=1, executions=5, step_ms=4.4)
    await tick(collector, clock)
    quiet_newcomer = triton.add(FakeModel("quiet"))
    await tick(collector, clock)
    assert sorted(collector.models) == ["busy", "idle"], "an idle newcomer waits"
    assert collector.untracked == 1
    newcomer = triton.add(FakeModel("newcomer"))
    newcomer.run(batch_size=1, executions=5, step_ms=4.4)
    await tick(collector, clock)  # its first page: not yet known to be busy
    newcomer.run(batch_size=1, executions=5, step_ms=4.4)
    busy.run(batch_size=1, executions=5, step_ms=4.4)
    await tick(collector, clock)
    assert sorted(collector.models) == ["busy", "newcomer"]
    assert collector.evicted == 1
    assert quiet_newcomer.name not in collector.models


async def test_a_model_gone_from_triton_is_forgotten() -> None:
    model = FakeModel("gpu_sim")
    triton = FakeTriton(model)
    clock = Clock()
    collector = make_collector(triton, clock, forget_after=10.0)
    await collector.collect()
    del triton.models["gpu_sim"]
    await tick(collector, clock, 5)
    assert "gpu_sim" in collector.models
    await tick(collector, clock, 6)
    assert collector.models == {}


async def test_gpu_readings_are_kept_with_the_rest() -> None:
    clock = Clock()
    collector = make_collector(FakeTriton(FakeModel("gpu_sim")), clock, monitor=one_gpu())
    await collector.collect()
    assert collector.gpu.available
    assert collector.gpu.gpus[0].name == "NVIDIA L4"


def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="interval must be positive"):
        collecting.Settings(interval=0)
    with pytest.raises(ValueError, match="at least 1"):
        collecting.Settings(max_models=0)


def test_batch_totals_add_up_versions_and_observations_count_from_a_reset() -> None:
    stats = [
        {"name": "m", "batch_stats": [{"batch_size": 2, "compute_infer": {"count": 3, "ns": 9e6}}]},
        {"name": "m", "batch_stats": [{"batch_size": 2, "compute_infer": {"count": 1, "ns": 3e6}}]},
    ]
    assert collecting.batch_totals(stats) == {"m": {2: (4, 12_000_000)}}
    after_reload = {2: (1, 2_000_000)}
    (observation,) = collecting.observations_between({2: (4, 12_000_000)}, after_reload)
    assert (observation.executions, observation.mean_ms) == (1, 2.0)
