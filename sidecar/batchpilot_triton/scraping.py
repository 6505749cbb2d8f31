"""Triton's Prometheus metrics, parsed series by series and turned into per-model rates.

Triton exports cumulative counters (requests, executions, microseconds spent queued and
computing), a pending-request gauge, and, with `--metrics-config summary_latencies=true`,
latency quantiles over a recent window. What happened between two scrapes is the increase of
every series, as PromQL's `increase()` sees it: a new series counts from zero, a vanished one
counts nothing, and one that went down was reset (the server restarted). Working series by
series matters: a reload starts new Python-backend stubs whose custom counters start at zero
while the old stubs' series linger for a while, so per-model sums would jump backwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from batchpilot_triton import engine_metrics

REQUEST_SUCCESS = "nv_inference_request_success"
REQUEST_FAILURE = "nv_inference_request_failure"
QUEUE_DURATION_US = "nv_inference_queue_duration_us"
# Families by the name the Prometheus parser gives them (counters lose their `_total`),
# mapped to the ModelCounters field they add to.
COUNTER_FIELDS = {
    REQUEST_SUCCESS: "requests_succeeded",
    REQUEST_FAILURE: "requests_failed",
    "nv_inference_count": "inferences",
    "nv_inference_exec_count": "executions",
    "nv_inference_request_duration_us": "request_us",
    QUEUE_DURATION_US: "queue_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    # The demo models' emulated accelerator: manifests/model-repository/*/1/emulated_device.py
    # exports these (a unit test keeps the names in step).
    "emulated_device_busy_seconds": "device_busy_seconds",
    "emulated_device_wait_seconds": "device_wait_seconds",
    "emulated_device_executions": "device_executions",
    "emulated_device_inferences": "device_inferences",
}
EMULATED_DEVICE_FAMILIES = tuple(name for name in COUNTER_FIELDS if name.startswith("emulated_"))
PENDING = "nv_inference_pending_request_count"
REQUEST_SUMMARY_US = "nv_inference_request_summary_us"
GPU_UTILIZATION = "nv_gpu_utilization"
GPU_MEMORY_USED = "nv_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "nv_gpu_memory_total_bytes"
_GPU_GAUGES = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL)

SeriesKey = tuple[str, frozenset[tuple[str, str]]]


@dataclass(frozen=True, kw_only=True)
class ModelCounters:
    """Counts of one model, summed over its versions, instances and stubs."""

    requests_succeeded: float = 0.0
    requests_failed: float = 0.0
    inferences: float = 0.0
    """Batch items executed (nv_inference_count)."""
    executions: float = 0.0
    """Batches executed (nv_inference_exec_count)."""
    request_us: float = 0.0
    queue_us: float = 0.0
    compute_infer_us: float = 0.0
    device_busy_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    device_executions: float = 0.0
    device_inferences: float = 0.0

    @property
    def requests(self) -> float:
        return self.requests_succeeded + self.requests_failed

    @property
    def average_batch_size(self) -> float | None:
        return self.inferences / self.executions if self.executions else None

    @property
    def device_seconds_per_1000_inferences(self) -> float | None:
        if not self.device_inferences:
            return None
        return 1000.0 * self.device_busy_seconds / self.device_inferences

    @property
    def queue_ms_per_request(self) -> float | None:
        return self.queue_us / self.requests / 1000 if self.requests else None

    @property
    def latency_ms_per_request(self) -> float | None:
        return self.request_us / self.requests / 1000 if self.requests else None

    @property
    def compute_ms_per_request(self) -> float | None:
        """Triton adds a batch's compute time to every request in it, so this is the compute
        time a request saw; per execution it takes the statistics extension's batch stats."""
        return self.compute_infer_us / self.requests / 1000 if self.requests else None


@dataclass(frozen=True)
class Snapshot:
    """A whole metrics page at one instant, series by series."""

    taken_at: float
    """Monotonic seconds."""
    counters: Mapping[SeriesKey, float] = field(default_factory=dict)
    gauges: Mapping[SeriesKey, float] = field(default_factory=dict)
    request_quantiles_us: Mapping[str, Mapping[float, float]] = field(default_factory=dict)
    """Per model: quantile -> microseconds, the worst version's."""
    summaries_enabled: bool = False
    engine_counters: Mapping[SeriesKey, float] = field(default_factory=dict)
    """An LLM engine's counters and histogram samples, keyed by sample name."""

    def models(self) -> set[str]:
        return {
            dict(labels)["model"]
            for _, labels in (*self.counters, *self.gauges)
            if any(key == "model" for key, _ in labels)
        }

    def pending(self, model: str) -> float:
        return sum(
            value
            for (family, labels), value in self.gauges.items()
            if family == PENDING and ("model", model) in labels
        )

    def gpu_values(self, family: str) -> tuple[float, ...]:
        return tuple(value for (name, _), value in self.gauges.items() if name == family)

    def totals(self, model: str) -> ModelCounters:
        """Everything counted since the series began."""
        return _sum(model, self.counters)


def parse(text: str, *, taken_at: float = 0.0) -> Snapshot:
    counters: dict[SeriesKey, float] = {}
    gauges: dict[SeriesKey, float] = {}
    quantiles: dict[str, dict[float, float]] = {}
    summaries_enabled = False
    engine: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (family.name, frozenset(sample.labels.items()))
            if family.name in COUNTER_FIELDS and not sample.name.endswith("_created"):
                counters[key] = sample.value
            elif family.name == PENDING or family.name in _GPU_GAUGES:
                gauges[key] = sample.value
            elif engine_metrics.is_counted(family.name):
                if not sample.name.endswith("_created"):
                    engine[(sample.name, frozenset(sample.labels.items()))] = sample.value
            elif family.name in engine_metrics.GAUGES:
                gauges[key] = sample.value
            elif family.name == REQUEST_SUMMARY_US and "model" in sample.labels:
                summaries_enabled = True
                if "quantile" in sample.labels and sample.value == sample.value:  # not NaN
                    per_model = quantiles.setdefault(sample.labels["model"], {})
                    quantile = float(sample.labels["quantile"])
                    per_model[quantile] = max(per_model.get(quantile, 0.0), sample.value)
    return Snapshot(taken_at, counters, gauges, quantiles, summaries_enabled, engine)


def _sum(model: str, values: Mapping[SeriesKey, float]) -> ModelCounters:
    return _sum_by_model(values).get(model, ModelCounters())


def _sum_by_model(values: Mapping[SeriesKey, float]) -> dict[str, ModelCounters]:
    """Every model's sums in one pass over the series (pages with many models are long)."""
    sums: dict[str, dict[str, float]] = {}
    for (family, labels), value in values.items():
        model = dict(labels).get("model")
        if model is not None:
            totals = sums.setdefault(model, dict.fromkeys(COUNTER_FIELDS.values(), 0.0))
            totals[COUNTER_FIELDS[family]] += value
    return {model: ModelCounters(**totals) for model, totals in sums.items()}


def _increases(before: Snapshot, after: Snapshot) -> dict[SeriesKey, float]:
    return _series_increases(before.counters, after.counters)


def _series_increases(
    before: Mapping[SeriesKey, float], after: Mapping[SeriesKey, float]
) -> dict[SeriesKey, float]:
    increases = {}
    for key, value in after.items():
        earlier = before.get(key, 0.0)
        increases[key] = value - earlier if value >= earlier else value
    return increases


def increase(before: Snapshot, after: Snapshot, model: str) -> ModelCounters:
    """What was counted for `model` between two snapshots of the same server."""
    return _sum(model, _increases(before, after))


@dataclass(frozen=True)
class ModelRates:
    """What one model did between two snapshots."""

    seconds: float
    counted: ModelCounters
    pending: float
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    engine: engine_metrics.EngineCounts | None = None
    """For a model served by an LLM engine that exports its metrics: what the engine counted."""

    @property
    def request_rate(self) -> float:
        return self.counted.requests / self.seconds


def rates(before: Snapshot, after: Snapshot) -> dict[str, ModelRates]:
    """Per-model rates between two snapshots of the same server."""
    seconds = after.taken_at - before.taken_at
    if seconds <= 0:
        return {}
    counted = _sum_by_model(_increases(before, after))
    pending: dict[str, float] = {}
    for (family, labels), value in after.gauges.items():
        model = dict(labels).get("model")
        if family == PENDING and model is not None:
            pending[model] = pending.get(model, 0.0) + value
    engines = engine_metrics.engine_counts(
        _series_increases(before.engine_counters, after.engine_counters), after.gauges
    )
    found = {}
    for model in after.models():
        quantiles = after.request_quantiles_us.get(model, {})

        def quantile_ms(q: float, quantiles: Mapping[float, float] = quantiles) -> float | None:
            value = quantiles.get(q)
            return value / 1000 if value is not None else None

        found[model] = ModelRates(
            seconds=seconds,
            counted=counted.get(model, ModelCounters()),
            pending=pending.get(model, 0.0),
            p50_ms=quantile_ms(0.5),
            p95_ms=quantile_ms(0.95),
            p99_ms=quantile_ms(0.99),
            engine=engines.get(model),
        )
    return found
