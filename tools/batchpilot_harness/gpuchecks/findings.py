"""What one GPU check run found: the figures `runs` measures and `verdicts` judges.

Kept apart from `runs` (which starts servers and imports the product) so that the verdict and
the report are pure functions of these values, tested on recorded figures.
"""

from __future__ import annotations

import dataclasses

from batchpilot_harness.gpuchecks import accounting, devices, plans
from batchpilot_triton import reports


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    moment: str
    gpus: tuple[devices.GpuComparison, ...]
    sidecar_gpu: str
    """The sidecar's GPU status and reason, as its /status gives them."""
    smi_problem: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Findings:
    plan: str
    device: plans.Device
    """cuda or cpu: what the readings are compared against depends on it."""
    gpu: int
    """The NVML index of the GPU the model ran on (cuda)."""
    startup_seconds: float
    comparisons: tuple[Comparison, ...]
    step_time: reports.StepTimeReport | None
    initial: accounting.Switch
    switches: tuple[accounting.SwitchAccount, ...]
    profiles: tuple[accounting.ProfileAccount, ...]
    sent: int
    """Requests the run's schedule sent (every arrival of the load)."""
    all_requests: accounting.Latencies
    failures: tuple[str, ...]
    """The kinds of failure the clients saw, most frequent first, each with its count."""
    samples: int
    problems: tuple[str, ...]
    """What the run saw go wrong as it happened (a switch the runner could not make, a GPU the
    sidecar did not read); `verdicts.problems` adds what the figures show."""
