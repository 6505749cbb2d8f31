"""The demo model repository, and the counters its models leave on Triton's metrics endpoint.

`manifests/model-repository` (in a source checkout) holds two Python-backend models that share one
emulated accelerator per server:

- `gpu_sim` costs nothing but device time: a batch of b holds the device for
  `t0 + c * b**alpha` (its `StepTime`, from config.pbtxt);
- `torch_mlp` is a real MLP run with torch on the CPU while it holds the device.

Tests, the demo and the benchmarks compare configurations by what the counters of a model
increased by under load (`MetricsSnapshot.increase`): average batch size from Triton's own
counters, device-seconds per 1,000 inferences from the emulated device's.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "manifests" / "model-repository"
GPU_SIM = "gpu_sim"
TORCH_MLP = "torch_mlp"

# Exported by manifests/model-repository/*/1/emulated_device.py; keep the two in step.
DEVICE_BUSY_SECONDS = "emulated_device_busy_seconds_total"
DEVICE_WAIT_SECONDS = "emulated_device_wait_seconds_total"
DEVICE_EXECUTIONS = "emulated_device_executions_total"
DEVICE_INFERENCES = "emulated_device_inferences_total"


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCounters:
    """Counters of one model, summed over its versions, instances and stubs."""

    requests_succeeded: float = 0.0
    requests_failed: float = 0.0
    inferences: float = 0.0  # batch items executed (nv_inference_count)
    executions: float = 0.0  # batches executed (nv_inference_exec_count)
    queue_seconds: float = 0.0
    compute_infer_seconds: float = 0.0
    device_busy_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    device_executions: float = 0.0
    device_inferences: float = 0.0

    @property
    def average_batch_size(self) -> float | None:
        return self.inferences / self.executions if self.executions else None

    @property
    def device_seconds_per_1000_inferences(self) -> float | None:
        if not self.device_inferences:
            return None
        return 1000.0 * self.device_busy_seconds / self.device_inferences


# Family names as prometheus_client's parser reports them: counters lose their `_total`.
_FIELDS_BY_FAMILY = {
    "nv_inference_request_success": "requests_succeeded",
    "nv_inference_request_failure": "requests_failed",
    "nv_inference_count": "inferences",
    "nv_inference_exec_count": "executions",
    "nv_inference_queue_duration_us": "queue_seconds",
    "nv_inference_compute_infer_duration_us": "compute_infer_seconds",
    DEVICE_BUSY_SECONDS.removesuffix("_total"): "device_busy_seconds",
    DEVICE_WAIT_SECONDS.removesuffix("_total"): "device_wait_seconds",
    DEVICE_EXECUTIONS.removesuffix("_total"): "device_executions",
    DEVICE_INFERENCES.removesuffix("_total"): "device_inferences",
}
_MICROSECOND_FAMILIES = {"nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"}

_SeriesKey = tuple[str, frozenset[tuple[str, str]]]


@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    """The counters of the demo models at one scrape, series by series.

    Series come and go: a reload starts new stubs whose device counters start at zero, and the
    old stubs' series vanish when those finish. `increase` therefore works per series, like
    PromQL's `increase()`: a new series counts from zero, a vanished one (an idle old stub)
    counts nothing, and a series that went down was reset.
    """

    series: Mapping[_SeriesKey, float]

    @classmethod
    def parse(cls, metrics_text: str) -> MetricsSnapshot:
        series: dict[_SeriesKey, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            if family.name not in _FIELDS_BY_FAMILY:
                continue
            scale = 1e-6 if family.name in _MICROSECOND_FAMILIES else 1.0
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    key = (family.name, frozenset(sample.labels.items()))
                    series[key] = sample.value * scale
        return cls(series)

    @classmethod
    def scrape(cls, metrics_url: str) -> MetricsSnapshot:
        with urllib.request.urlopen(metrics_url, timeout=10.0) as response:  # noqa: S310
            return cls.parse(response.read().decode())

    def totals(self, model: str) -> ModelCounters:
        """Everything counted since the series began."""
        return self._sum(model, self.series)

    def increase(self, since: MetricsSnapshot, model: str) -> ModelCounters:
        """What was counted between `since` and this snapshot."""
        increases = {}
        for key, value in self.series.items():
            earlier = since.series.get(key, 0.0)
            increases[key] = value - earlier if value >= earlier else value
        return self._sum(model, increases)

    @staticmethod
    def _sum(model: str, values: Mapping[_SeriesKey, float]) -> ModelCounters:
        totals = dict.fromkeys(_FIELDS_BY_FAMILY.values(), 0.0)
        for (family, labels), value in values.items():
            if ("model", model) in labels:
                totals[_FIELDS_BY_FAMILY[family]] += value
        return ModelCounters(**totals)
