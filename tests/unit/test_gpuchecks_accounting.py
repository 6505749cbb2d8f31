"""The GPU check's figures from timed observations: device-seconds from NVML utilization samples,
per profile and per 1,000 requests, and the requests of switches apart from steady state."""

from __future__ import annotations

import pytest

from batchpilot_harness.gpuchecks import accounting
from batchpilot_triton import scraping

Sample = accounting.Sample


def switch(profile: str, asked: float, served: float, *reloads: float) -> accounting.Switch:
    return accounting.Switch(
        profile=profile,
        previous=None,
        asked_at=asked,
        served_at=served,
        reload_seconds=reloads,
    )


def ok(sent: float, latency: float = 0.005) -> accounting.Request:
    return accounting.Request(sent=sent, latency=latency, succeeded=True)


def failed(sent: float) -> accounting.Request:
    return accounting.Request(sent=sent, latency=None, succeeded=False)


def test_each_reading_stands_for_the_time_since_the_one_before() -> None:
    samples = [Sample(0.0, 0.9), Sample(1.0, 0.5), Sample(2.0, 0.25)]
    # The first reading covers nothing before it; the others cover one second each.
    assert accounting.busy_seconds(samples, 0.0, 2.0) == (0.75, 2.0)


def test_busy_seconds_are_clipped_to_the_window() -> None:
    samples = [Sample(0.0, 0.0), Sample(1.0, 0.5), Sample(2.0, 1.0)]
    busy, covered = accounting.busy_seconds(samples, 0.5, 1.5)
    assert busy == pytest.approx(0.5 * 0.5 + 1.0 * 0.5)
    assert covered == pytest.approx(1.0)


def test_missing_readings_count_neither_busy_nor_covered() -> None:
    samples = [Sample(0.0, None), Sample(1.0, None), Sample(2.0, 0.4)]
    assert accounting.busy_seconds(samples, 0.0, 2.0) == (0.4, 1.0)
    assert accounting.busy_seconds([Sample(1.0, 0.3)], 0.0, 2.0) == (0.0, 0.0)


def test_a_profile_is_in_force_from_its_reload_until_the_next_one() -> None:
    switches = [
        switch("interactive", -3.0, -1.0),
        switch("bulk", 10.0, 11.5),
        switch("interactive", 20.0, 21.0),
    ]
    assert accounting.stretches(switches, start=0.0, end=30.0) == (
        accounting.Stretch("interactive", 0.0, 11.5),
        accounting.Stretch("bulk", 11.5, 21.0),
        accounting.Stretch("interactive", 21.0, 30.0),
    )


def test_latencies_of_successes_and_a_count_of_failures() -> None:
    requests = [ok(float(i), latency=(i + 1) / 1000) for i in range(100)] + [failed(5.0)]
    figures = accounting.latencies(requests)
    assert (figures.requests, figures.failed) == (101, 1)
    assert figures.p50_ms == pytest.approx(50.5)
    assert figures.p99_ms == pytest.approx(99.01)
    assert figures.max_ms == pytest.approx(100.0)
    assert accounting.latencies([failed(1.0)]).p99_ms is None


def counters(inferences: float, executions: float, busy: float) -> scraping.ModelCounters:
    return scraping.ModelCounters(
        requests_succeeded=inferences,
        inferences=inferences,
        executions=executions,
        device_busy_seconds=busy,
        device_executions=executions,
        device_inferences=inferences,
    )


def test_device_seconds_per_1000_requests_per_profile_from_utilization() -> None:
    switches = [switch("interactive", -2.0, -1.0), switch("bulk", 10.0, 10.0, 0.8)]
    # Interactive keeps the GPU 60% busy for 10 s, bulk 20% for 10 s; 100 requests a second.
    samples = [Sample(float(t), 0.6 if t <= 10 else 0.2) for t in range(21)]
    requests = [ok(t / 100) for t in range(2000)]
    found = accounting.stretches(switches, start=0.0, end=20.0)
    counted = dict(zip(found, [counters(1000, 500, 5.0), counters(1000, 50, 1.0)], strict=True))
    interactive, bulk = accounting.profile_accounts(
        switches=switches,
        requests=requests,
        samples=samples,
        counted=counted,
        start=0.0,
        end=20.0,
    )
    assert (interactive.profile, bulk.profile) == ("interactive", "bulk")
    assert interactive.device_seconds == pytest.approx(6.0)
    assert bulk.device_seconds == pytest.approx(2.0)
    assert (interactive.served, bulk.served) == (1000, 1000)
    assert interactive.device_seconds_per_1000 == pytest.approx(6.0)
    assert bulk.device_seconds_per_1000 == pytest.approx(2.0)
    assert interactive.utilization == pytest.approx(0.6)
    assert bulk.counted.average_batch_size == 20
    # The model's own timer, for comparison with NVML.
    assert interactive.timer_seconds_per_1000 == pytest.approx(5.0)
    assert bulk.timer_seconds_per_1000 == pytest.approx(1.0)


def test_without_gpu_readings_there_are_no_device_seconds_but_the_rest_is_counted() -> None:
    switches = [switch("interactive", -2.0, -1.0)]
    samples = [Sample(float(t), None) for t in range(11)]
    (account,) = accounting.profile_accounts(
        switches=switches,
        requests=[ok(1.0), failed(2.0)],
        samples=samples,
        counted={},
        start=0.0,
        end=10.0,
    )
    assert account.device_seconds is None
    assert account.device_seconds_per_1000 is None
    assert account.timer_seconds_per_1000 is None
    assert (account.requests, account.failed, account.served) == (2, 1, 1)


def test_requests_sent_during_a_switch_are_the_switchs_and_not_steady_state() -> None:
    switches = [switch("interactive", -2.0, -1.0), switch("bulk", 10.0, 12.0, 1.9)]
    # Steady requests are fast; those sent from the ask until a second after the reload stall.
    requests = [ok(t / 10, 0.2 if 10.0 <= t / 10 < 13.0 else 0.01) for t in range(200)]
    requests.append(failed(11.0))
    interactive, bulk = accounting.profile_accounts(
        switches=switches, requests=requests, samples=[], counted={}, start=0.0, end=20.0
    )
    assert interactive.steady.max_ms == pytest.approx(10.0)
    assert bulk.steady.max_ms == pytest.approx(10.0)
    assert bulk.switching.requests == 31  # 10.0 to 12.9 s, and the failure
    assert bulk.switching.failed == 1
    assert bulk.switching.p99_ms == pytest.approx(200.0)
    assert interactive.switching.requests == 0  # its switch came before the load
    assert interactive.failed == 1  # sent while interactive still served

    (moment,) = accounting.switch_accounts(switches[1:], requests)
    assert moment.decision_to_served_seconds == pytest.approx(2.0)
    assert moment.switch.reload_seconds == (1.9,)
    assert (moment.requests.requests, moment.requests.failed) == (31, 1)


def metrics_page(busy: float, inferences: float) -> str:
    return (
        "# TYPE nv_inference_count counter\n"
        f'nv_inference_count{{model="torch_mlp",version="1"}} {inferences}\n'
        "# TYPE emulated_device_busy_seconds_total counter\n"
        f'emulated_device_busy_seconds_total{{model="torch_mlp",version="1"}} {busy}\n'
    )


def test_triton_counters_per_stretch_come_from_the_snapshots_nearest_its_ends() -> None:
    snapshots = [
        scraping.parse(metrics_page(0.0, 0), taken_at=0.05),
        scraping.parse(metrics_page(4.0, 1000), taken_at=10.1),
        scraping.parse(metrics_page(5.0, 2000), taken_at=19.9),
    ]
    found = (accounting.Stretch("interactive", 0.0, 10.0), accounting.Stretch("bulk", 10.0, 20.0))
    counted = accounting.counters_by_stretch(found, snapshots, "torch_mlp")
    assert counted[found[0]].inferences == 1000
    assert counted[found[0]].device_busy_seconds == 4.0
    assert counted[found[1]].inferences == 1000
    assert counted[found[1]].device_busy_seconds == 1.0
    assert accounting.counters_by_stretch(found, [], "torch_mlp") == {}
