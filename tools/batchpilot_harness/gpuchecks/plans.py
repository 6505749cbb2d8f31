"""What one GPU check run does: the device, the model's size, the load and the profiles' order.

Defaults differ by device: on a GPU the model is made big enough (8192 wide, 4 hidden layers:
about a gigabyte of weights read per batch) that NVML sees it busy, and the load is one a
16-core machine sends easily; on the CPU it is the benchmarks' small model at a rate two shared
cores serve, for a run of about half a minute.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from batchpilot_harness import demo_models

MODEL = demo_models.TORCH_MLP
Device = Literal["cuda", "cpu"]
PROFILE_ORDER = ("interactive", "bulk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    device: Device
    gpu: int = 0
    """The NVML (PCI bus order) index of the GPU the model runs on."""
    rate: float
    """Requests per second, Poisson, for the whole run."""
    segment_seconds: float
    cycles: int
    """Each cycle is one segment of each profile."""
    hidden_width: int
    hidden_layers: int
    out: Path
    model_repository: Path = demo_models.MODEL_REPOSITORY
    tick_seconds: float = 1.0
    sample_seconds: float = 0.5
    ready_timeout: float = 600.0
    seed: int = 17

    @property
    def profiles(self) -> list[str]:
        """The profile of each segment, in order."""
        return list(PROFILE_ORDER) * self.cycles

    @property
    def load_seconds(self) -> float:
        return self.segment_seconds * len(self.profiles)

    def describe(self) -> str:
        where = f"cuda (GPU {self.gpu})" if self.device == "cuda" else "cpu"
        return (
            f"{MODEL} (hidden {self.hidden_width} x {self.hidden_layers}) on {where}; "
            f"{self.rate:g} req/s for {self.load_seconds:g} s; the profile alternates "
            f"{' -> '.join(self.profiles)} every {self.segment_seconds:g} s"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Defaults:
    rate: float
    segment_seconds: float
    cycles: int
    hidden_width: int
    hidden_layers: int


DEFAULTS: dict[Device, Defaults] = {
    "cuda": Defaults(
        rate=800.0, segment_seconds=30.0, cycles=2, hidden_width=8192, hidden_layers=4
    ),
    "cpu": Defaults(rate=100.0, segment_seconds=8.0, cycles=2, hidden_width=1024, hidden_layers=2),
}
