"""The demo model repository, and the counters its models leave on Triton's metrics endpoint.

`manifests/model-repository` (in a source checkout) holds two Python-backend models that share one
emulated accelerator per server:

- `gpu_sim` costs nothing but device time: a batch of b holds the device for
  `t0 + c * b**alpha` (its `StepTime`, from config.pbtxt);
- `torch_mlp` is a real MLP run with torch on the CPU while it holds the device.

Tests, the demo and the benchmarks compare configurations by what the counters of a model
increased by under load (`batchpilot_triton.scraping.increase`): average batch size from
Triton's own counters, device-seconds per 1,000 inferences from the emulated device's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "manifests" / "model-repository"
GPU_SIM = "gpu_sim"
TORCH_MLP = "torch_mlp"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTime:
    """How long gpu_sim holds the device for a batch: `base + per_item * batch**exponent`."""

    base_ms: float
    per_item_ms: float
    exponent: float

    def seconds(self, batch_size: int) -> float:
        return (self.base_ms + self.per_item_ms * math.pow(batch_size, self.exponent)) / 1000.0

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> StepTime:
        """From the model configuration JSON that Triton serves (`get_model_config`)."""
        parameters = config["parameters"]

        def number(key: str) -> float:
            return float(parameters[key]["string_value"])

        return cls(
            base_ms=number("step_time_base_ms"),
            per_item_ms=number("step_time_per_item_ms"),
            exponent=number("step_time_exponent"),
        )
