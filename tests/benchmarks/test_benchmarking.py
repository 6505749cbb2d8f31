"""The benchmarks' accounting on made-up records and metrics pages: what a figure means."""

from __future__ import annotations

import datetime

import benchmarking
import pytest

from batchpilot_harness import loadgen
from batchpilot_triton import scraping

at = datetime.time


def record(
    scheduled: float, latency_ms: float | None, status: int | None = 200
) -> loadgen.RequestRecord:
    return loadgen.RequestRecord(
        phase=0,
        scheduled=scheduled,
        sent=None if status is None and latency_ms is None else scheduled,
        latency=None if latency_ms is None else latency_ms / 1000,
        status=status,
    )


def day(speed: float = 60.0) -> benchmarking.TradingDay:
    return benchmarking.TradingDay(
        date=datetime.date(2026, 11, 17),
        timezone="America/New_York",
        phases=(
            benchmarking.DayPhase(name="pre", start=at(9), end=at(9, 30), rate=10),
            benchmarking.DayPhase(name="session", start=at(9, 30), end=at(10, 30), rate=100),
        ),
        bursts=(benchmarking.Burst(label="burst", start=at(9, 40), end=at(9, 50), rate=300),),
        speed=speed,
    )


def test_a_day_replays_its_phases_and_bursts_as_consecutive_segments() -> None:
    segments = day().segments()
    assert [(s.label, s.start, s.end, s.rate) for s in segments] == [
        ("pre", 0.0, 30.0, 10),
        ("session", 30.0, 40.0, 100),
        ("burst", 40.0, 50.0, 300),
        ("session", 50.0, 90.0, 100),
    ]
    assert [s.phase for s in segments] == [0, 1, 1, 1]
    assert [p.seconds for p in day().load_phases()] == [30.0, 10.0, 10.0, 40.0]
    assert day().seconds == 90.0


def test_the_virtual_clock_runs_speed_times_faster_from_the_first_phase() -> None:
    replayed = day(speed=60.0)
    assert replayed.virtual(30.0) == replayed.instant(at(9, 30))
    assert replayed.virtual(30.0).utcoffset() == datetime.timedelta(hours=-5)
    readings = iter([100.0, 100.0, 130.0])
    clock = replayed.clock(origin=100.5, monotonic=lambda: next(readings))
    assert clock() == replayed.instant(at(9))  # before the load: the start of the day
    assert clock() == replayed.instant(at(9))
    assert clock() == replayed.instant(at(9, 29, 30))
    assert replayed.phase_of(29.9) == 0
    assert replayed.phase_of(30.0) == 1
    assert replayed.phase_of(90.0) is None


def test_a_burst_outside_every_phase_is_refused() -> None:
    with pytest.raises(ValueError, match="within one phase"):
        benchmarking.TradingDay(
            date=datetime.date(2026, 11, 17),
            timezone="UTC",
            phases=(benchmarking.DayPhase(name="only", start=at(9), end=at(10), rate=1),),
            bursts=(benchmarking.Burst(label="late", start=at(9, 50), end=at(10, 10), rate=2),),
        )


def test_a_window_meets_the_slo_only_with_its_p95_within_it_and_nothing_failed() -> None:
    fast = [record(0.1 * i, 10.0) for i in range(100)]
    slow_tail = [record(10 + 0.1 * i, 50.0 if i >= 90 else 10.0) for i in range(100)]
    one_failure = [record(20 + 0.1 * i, 10.0) for i in range(99)] + [record(29.95, None, 503)]
    found = benchmarking.windows(fast + slow_tail + one_failure, start=0.0, end=30.0)
    assert [(w.start, w.end, w.requests, w.failed) for w in found] == [
        (0.0, 10.0, 100, 0),
        (10.0, 20.0, 100, 0),
        (20.0, 30.0, 100, 1),
    ]
    assert [w.meets(25.0) for w in found] == [True, False, False]
    assert found[1].p95_ms == pytest.approx(50.0)
    assert benchmarking.share_meeting(found, 25.0) == pytest.approx(1 / 3)
    assert found[0].throughput == pytest.approx(10.0)


def test_an_arrival_never_sent_counts_as_a_failure() -> None:
    never_sent = loadgen.RequestRecord(phase=0, scheduled=1.0, sent=None, latency=None, status=None)
    (window,) = benchmarking.windows([record(0.5, 5.0), never_sent], start=0.0, end=10.0)
    assert window.failed == 1
    assert not window.meets(100.0)
    assert benchmarking.failures([never_sent]) == 1


def test_a_request_in_flight_when_a_stall_begins_overlaps_it() -> None:
    queued_before = record(4.9, 1200.0)
    done_before = record(4.0, 10.0)
    sent_during = record(5.5, 20.0)
    sent_after = record(7.0, 20.0)
    never_sent = loadgen.RequestRecord(phase=0, scheduled=6.0, sent=None, latency=None, status=None)
    found = benchmarking.overlapping(
        [queued_before, done_before, sent_during, sent_after, never_sent], 5.0, 6.5
    )
    assert found == [queued_before, sent_during, never_sent]


def test_a_short_tail_window_is_left_out_and_an_empty_window_meets_the_slo() -> None:
    found = benchmarking.windows([record(1.0, 5.0)], start=0.0, end=24.0)
    assert [(w.start, w.end) for w in found] == [(0.0, 10.0), (10.0, 20.0)]
    assert found[1].requests == 0
    assert found[1].meets(1.0)
    assert [(w.start, w.end) for w in benchmarking.windows([], start=0.0, end=26.0)][-1] == (
        20.0,
        26.0,
    )


def page(*, busy: float, inferences: float, executions: float, model: str = "m") -> str:
    """A metrics page as Triton serves it, the emulated device's counters included."""
    labels = f'model="{model}",version="1"'
    return "\n".join(
        [
            "# TYPE nv_inference_count counter",
            f"nv_inference_count{{{labels}}} {inferences}",
            "# TYPE nv_inference_exec_count counter",
            f"nv_inference_exec_count{{{labels}}} {executions}",
            "# TYPE emulated_device_busy_seconds_total counter",
            f"emulated_device_busy_seconds_total{{{labels}}} {busy}",
            "# TYPE emulated_device_inferences_total counter",
            f"emulated_device_inferences_total{{{labels}}} {inferences}",
            "",
        ]
    )


def test_device_seconds_and_batch_size_come_from_the_scrapes_inside_a_phase() -> None:
    series = [
        scraping.parse(page(busy=0.0, inferences=0, executions=0), taken_at=0.0),
        scraping.parse(page(busy=1.0, inferences=100, executions=50), taken_at=1.0),
        scraping.parse(page(busy=1.5, inferences=600, executions=60), taken_at=2.0),
    ]
    first = benchmarking.counted_between(series, "m", 0.0, 1.0)
    second = benchmarking.counted_between(series, "m", 1.0, 2.0)
    assert first.average_batch_size == pytest.approx(2.0)
    assert benchmarking.device_seconds_per_1000(first) == pytest.approx(10.0)
    assert second.average_batch_size == pytest.approx(50.0)
    assert benchmarking.device_seconds_per_1000(second) == pytest.approx(1.0)
    both = benchmarking.counted_between(series, "m", 0.0, 2.0)
    assert both.inferences == 600
    assert both.device_busy_seconds == pytest.approx(1.5)


def test_a_phase_report_gathers_latency_failures_windows_and_device_time() -> None:
    records = [record(0.01 * i, 10.0 + (i % 10)) for i in range(2000)]
    records[5] = record(0.05, None, 500)
    series = [
        scraping.parse(page(busy=0.0, inferences=0, executions=0), taken_at=0.0),
        scraping.parse(page(busy=2.0, inferences=2000, executions=500), taken_at=20.0),
    ]
    report = benchmarking.phase_report(
        name="session", records=records, series=series, model="m", start=0.0, end=20.0, slo_ms=25
    )
    assert (report.requests, report.failed, report.windows, report.windows_meeting_slo) == (
        2000,
        1,
        2,
        1,
    )
    assert report.throughput == pytest.approx(1999 / 20)
    assert report.p50_ms == pytest.approx(14.0, abs=1.0)
    assert report.average_batch == pytest.approx(4.0)
    assert report.device_seconds_per_1000 == pytest.approx(1.0)
    assert report.share_meeting_slo == pytest.approx(0.5)


def test_ratios_and_cells_say_nothing_rather_than_divide_by_nothing() -> None:
    assert benchmarking.ratio(1.0, 2.0) == 0.5
    assert benchmarking.ratio(None, 2.0) is None
    assert benchmarking.ratio(1.0, 0.0) is None
    assert benchmarking.cell(None) == "-"
    assert benchmarking.cell(1.234, 2) == "1.23"
    text = benchmarking.table(["name", "value"], [["a", "1.0"], ["longer", "22.5"]])
    assert text.splitlines() == [
        "name    value",
        "------  -----",
        "a         1.0",
        "longer   22.5",
    ]
