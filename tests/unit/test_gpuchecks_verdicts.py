"""The GPU check's verdict on recorded figures: each way its subject can fail makes it fail, with
the reason, and a run where everything held passes. The first run on a GPU failed every request
and said OK; these are the checks that would have caught it."""

from __future__ import annotations

import dataclasses

from batchpilot_harness.gpuchecks import accounting, devices, findings, plans, verdicts
from batchpilot_triton import reports

FITTED = reports.StepTimeReport(
    status="fitted", batch_sizes=(1, 2, 4, 8), t0_ms=0.73, c_ms=0.45, alpha=0.53, r_squared=0.97
)
INITIAL = accounting.Switch("interactive", None, -3.0, -1.0, (2.5,))
TO_BULK = accounting.Switch("bulk", "interactive", 30.0, 34.0, (4.0,))
HTTP_500 = (
    'http://127.0.0.1:8000: {"error":"output tensor shape does not match size of output for '
    "'OUTPUT'\"}"
)


def requests(
    *, failing_from: float | None = None, error: str = HTTP_500
) -> list[accounting.Request]:
    """One request every 10 ms for a minute; from `failing_from` on, each fails."""
    sent = [t / 100 for t in range(6000)]
    return [
        accounting.Request(sent=t, latency=0.004, succeeded=True)
        if failing_from is None or t < failing_from
        else accounting.Request(sent=t, latency=0.001, succeeded=False, error=error)
        for t in sent
    ]


def smi_reading(**changes: object) -> devices.SmiReading:
    reading = devices.SmiReading(
        index=0,
        name="NVIDIA H200",
        utilization_percent=31,
        memory_used_mib=2048,
        memory_total_mib=143771,
        power_watts=180.0,
        power_limit_watts=700.0,
        sm_clock_mhz=1980,
        temperature_celsius=41,
    )
    return dataclasses.replace(reading, **changes)  # type: ignore[arg-type]


SIDECAR = reports.DeviceReport(
    index=0,
    name="NVIDIA H200",
    utilization=0.30,
    memory_used_bytes=2048 * 1024**2,
    memory_total_bytes=143771 * 1024**2,
    power_watts=180.4,
    power_limit_watts=700.0,
    sm_clock_mhz=1980,
    temperature_celsius=41,
)


def comparison(
    smi: devices.SmiReading | None = None, problem: str | None = None
) -> findings.Comparison:
    return findings.Comparison(
        moment="under load (bulk)",
        gpus=devices.compare([SIDECAR], [smi or smi_reading()]) if problem is None else (),
        sidecar_gpu="available via nvml",
        smi_problem=problem,
    )


def run(
    *,
    sent: list[accounting.Request] | None = None,
    scheduled: int | None = None,
    device: plans.Device = "cuda",
    comparisons: tuple[findings.Comparison, ...] | None = None,
    step_time: reports.StepTimeReport | None = FITTED,
    problems: tuple[str, ...] = (),
) -> findings.Findings:
    seen = requests() if sent is None else sent
    return findings.Findings(
        plan="torch_mlp on cuda (GPU 0)",
        device=device,
        gpu=0,
        startup_seconds=12.0,
        comparisons=(comparison(),) if comparisons is None else comparisons,
        step_time=step_time,
        initial=INITIAL,
        switches=accounting.switch_accounts([TO_BULK], seen),
        profiles=(),
        sent=len(seen) if scheduled is None else scheduled,
        all_requests=accounting.latencies(seen),
        failures=accounting.failure_kinds(seen),
        samples=120,
        problems=problems,
    )


def test_a_run_where_everything_held_passes() -> None:
    assert verdicts.problems(run()) == ()


def test_every_request_failing_fails_the_check_with_the_servers_words() -> None:
    # What the first GPU run saw: every response an HTTP 500 from the Python-backend stub.
    found = verdicts.problems(run(sent=requests(failing_from=0.0)))
    assert found[0] == "the switch to bulk failed 500 of the 500 requests sent during it"
    assert found[1] == "5500 of the 5500 requests sent outside the switches failed"
    assert (
        found[2] == f"served 0 of the 6000 requests the run sent; the clients saw 6000 x {HTTP_500}"
    )


def test_failures_outside_a_switch_fail_it_even_when_the_switch_served_all() -> None:
    (problem, served) = verdicts.problems(run(sent=requests(failing_from=50.0)))
    assert problem.startswith("1000 of the 5500 requests sent outside the switches failed")
    assert served.startswith(
        "served 5000 of the 6000 requests the run sent; the clients saw 1000 x"
    )


def test_a_switch_that_fails_requests_fails_the_check() -> None:
    seen = [
        dataclasses.replace(r, succeeded=False, error="ServerDisconnectedError")
        if 31.0 <= r.sent < 31.1
        else r
        for r in requests()
    ]
    assert verdicts.problems(run(sent=seen)) == (
        "the switch to bulk failed 10 of the 500 requests sent during it",
        "served 5990 of the 6000 requests the run sent; "
        "the clients saw 10 x ServerDisconnectedError",
    )


def test_fewer_answers_than_requests_sent_fails_the_check() -> None:
    # Arrivals the load could not send (too many in flight) never reach the per-request record.
    assert verdicts.problems(run(scheduled=6400)) == (
        "served 6000 of the 6400 requests the run sent",
    )


def test_nvidia_smi_that_could_not_be_read_fails_a_gpu_run() -> None:
    unreadable = comparison(problem="nvidia-smi's output could not be read: lacks clocks.sm")
    assert verdicts.problems(run(comparisons=(unreadable,))) == (
        "nvidia-smi could not be read under load (bulk): nvidia-smi's output could not be read: "
        "lacks clocks.sm",
    )


def test_a_reading_only_one_side_gave_fails_a_gpu_run_and_names_it() -> None:
    # The H200's answer under the long header name left the SM clock column empty.
    blank = comparison(smi_reading(sm_clock_mhz=None))
    assert verdicts.problems(run(comparisons=(blank,))) == (
        "GPU 0 could not be compared under load (bulk): SM clock MHz (none from nvidia-smi)",
    )


def test_the_power_limit_and_reserved_memory_are_shown_not_judged() -> None:
    assert (
        verdicts.problems(run(comparisons=(comparison(smi_reading(power_limit_watts=None)),))) == ()
    )


def test_the_gpu_of_the_run_missing_from_both_readings_fails_it() -> None:
    other = dataclasses.replace(comparison(), gpus=())
    assert verdicts.problems(run(comparisons=(other,))) == (
        "GPU 0 is in neither the sidecar's readings nor nvidia-smi's under load (bulk)",
    )


def test_a_cpu_run_has_no_gpu_readings_to_compare() -> None:
    assert verdicts.problems(run(device="cpu", comparisons=(comparison(problem="no smi"),))) == ()


def test_a_fit_that_did_not_converge_fails_the_check() -> None:
    unfitted = reports.StepTimeReport(status="insufficient", reason="1 distinct batch size")
    assert verdicts.problems(run(step_time=unfitted)) == (
        "the sidecar's step-time fit did not converge: insufficient: 1 distinct batch size",
    )
    assert verdicts.problems(run(step_time=None)) == ("the sidecar reported no step-time fit",)


def test_what_the_run_saw_go_wrong_comes_first() -> None:
    found = verdicts.problems(run(problems=("switch to bulk: HTTP 400 load failed",)))
    assert found == ("switch to bulk: HTTP 400 load failed",)
