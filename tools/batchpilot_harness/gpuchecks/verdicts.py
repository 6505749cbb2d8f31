"""Whether a GPU check passed: each way its subject can fail, judged from the findings alone.

The first run on a GPU machine failed all 96,743 of its requests (the Python-backend stub and
NumPy 2) and printed `gpu-check: OK`, because the check only looked at whether the runner's
switches were applied. A check that cannot fail is a defect, so every figure the check exists
to give is judged here: requests that failed outside a switch, a switch that failed requests,
a run that served fewer than it sent, GPU readings that could not be compared with nvidia-smi,
and a step-time fit that did not converge. Each problem is one sentence; the command line joins
them on its last line and exits non-zero.
"""

from __future__ import annotations

from collections.abc import Iterator

from batchpilot_harness.gpuchecks import devices, findings

COMPARED_READINGS = (
    "utilization %",
    "memory used MiB",
    "memory total MiB",
    "power W",
    "SM clock MHz",
    "temperature C",
)
"""What NVML (through the sidecar) and nvidia-smi must both give on the check's GPU. The power
limit and reserved memory are shown, not judged: neither is a figure the sidecar acts on."""


def problems(found: findings.Findings) -> tuple[str, ...]:
    """Everything that makes the run a failure, in the order a reader should fix them."""
    return (
        *found.problems,
        *_requests(found),
        *(_readings(found) if found.device == "cuda" else ()),
        *_fit(found),
    )


def _requests(found: findings.Findings) -> Iterator[str]:
    in_switches = 0
    for account in found.switches:
        failed = account.requests.failed
        in_switches += failed
        if failed:
            yield (
                f"the switch to {account.switch.profile} failed {failed} of the "
                f"{account.requests.requests} requests sent during it"
            )
    outside = found.all_requests.failed - in_switches
    if outside:
        sent_outside = found.all_requests.requests - sum(
            a.requests.requests for a in found.switches
        )
        yield f"{outside} of the {sent_outside} requests sent outside the switches failed"
    served = found.all_requests.requests - found.all_requests.failed
    if served < found.sent:
        seen = f"; the clients saw {'; '.join(found.failures)}" if found.failures else ""
        yield f"served {served} of the {found.sent} requests the run sent{seen}"


def _readings(found: findings.Findings) -> Iterator[str]:
    for comparison in found.comparisons:
        where = f"{comparison.moment}"
        if comparison.smi_problem:
            yield f"nvidia-smi could not be read {where}: {comparison.smi_problem}"
            continue
        gpu = next((g for g in comparison.gpus if g.index == found.gpu), None)
        if gpu is None:
            yield f"GPU {found.gpu} is in neither the sidecar's readings nor nvidia-smi's {where}"
            continue
        missing = [_missing(row) for row in gpu.rows if row.reading in COMPARED_READINGS]
        named = [text for text in missing if text]
        if named:
            yield f"GPU {found.gpu} could not be compared {where}: {', '.join(named)}"


def _missing(row: devices.Row) -> str | None:
    if row.difference is not None:
        return None
    lacking = [
        side
        for side, value in (("the sidecar", row.sidecar), ("nvidia-smi", row.smi))
        if value is None
    ]
    return f"{row.reading} (none from {' or '.join(lacking)})"


def _fit(found: findings.Findings) -> Iterator[str]:
    fit = found.step_time
    if fit is None:
        yield "the sidecar reported no step-time fit"
    elif fit.status != "fitted":
        yield f"the sidecar's step-time fit did not converge: {fit.status}: {fit.reason}"
