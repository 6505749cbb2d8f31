"""Triton's Prometheus metrics, parsed into per-model counters and turned into rates.

Triton exports cumulative counters (requests, executions, microseconds spent queued and
computing), a pending-request gauge, and, with `--metrics-config summary_latencies=true`,
latency quantiles over a recent window. Rates come from the difference of two snapshots; a
counter that went backwards means the server restarted, and the later value is the delta.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Triton's metric families, by the name the Prometheus parser gives them (counters lose
# their `_total` suffix).
SUCCESS = "nv_inference_request_success"
FAILURE = "nv_inference_request_failure"
INFERENCES = "nv_inference_count"
EXECUTIONS = "nv_inference_exec_count"
REQUEST_US = "nv_inference_request_duration_us"
QUEUE_US = "nv_inference_queue_duration_us"
COMPUTE_INFER_US = "nv_inference_compute_infer_duration_us"
PENDING = "nv_inference_pending_request_count"
REQUEST_SUMMARY_US = "nv_inference_request_summary_us"
QUEUE_SUMMARY_US = "nv_inference_queue_summary_us"
GPU_UTILIZATION = "nv_gpu_utilization"
GPU_MEMORY_USED = "nv_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "nv_gpu_memory_total_bytes"
# The demo models' emulated accelerator (manifests/model-repository).
EMULATED_DEVICE_BUSY = "emulated_device_busy_seconds"

_COUNTERS = (
    SUCCESS,
    FAILURE,
    INFERENCES,
    EXECUTIONS,
    REQUEST_US,
    QUEUE_US,
    COMPUTE_INFER_US,
    EMULATED_DEVICE_BUSY,
)


@dataclass(frozen=True)
class ModelSample:
    """One model's metrics at one instant (all versions together)."""

    counters: Mapping[str, float]
    pending: float
    request_quantiles_us: Mapping[float, float] = field(default_factory=dict)
    queue_quantiles_us: Mapping[float, float] = field(default_factory=dict)

    def counter(self, name: str) -> float:
        return self.counters.get(name, 0.0)


@dataclass(frozen=True)
class Snapshot:
    """A whole metrics page at one instant."""

    taken_at: float
    """Monotonic seconds."""
    models: Mapping[str, ModelSample]
    gpu_utilization: tuple[float, ...] = ()
    """Per GPU, 0..1, where Triton reports it (DCGM)."""
    gpu_memory_used_bytes: tuple[float, ...] = ()
    gpu_memory_total_bytes: tuple[float, ...] = ()
    summaries_enabled: bool = False


def parse(text: str, *, taken_at: float) -> Snapshot:
    counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    pending: dict[str, float] = defaultdict(float)
    quantiles: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    gpu: dict[str, list[float]] = defaultdict(list)
    summaries_enabled = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if family.name in _COUNTERS and model and not sample.name.endswith("_created"):
                counters[model][family.name] += sample.value
            elif family.name == PENDING and model:
                pending[model] += sample.value
            elif family.name in (REQUEST_SUMMARY_US, QUEUE_SUMMARY_US) and model:
                summaries_enabled = True
                if "quantile" in sample.labels and sample.value == sample.value:  # not NaN
                    quantile = float(sample.labels["quantile"])
                    # With several versions, the worst version is what users feel.
                    known = quantiles[family.name][model].get(quantile, 0.0)
                    quantiles[family.name][model][quantile] = max(known, sample.value)
            elif family.name in (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL):
                gpu[family.name].append(sample.value)
    names = set(counters) | set(pending)
    return Snapshot(
        taken_at=taken_at,
        models={
            name: ModelSample(
                counters=dict(counters[name]),
                pending=pending[name],
                request_quantiles_us=dict(quantiles[REQUEST_SUMMARY_US][name]),
                queue_quantiles_us=dict(quantiles[QUEUE_SUMMARY_US][name]),
            )
            for name in names
        },
        gpu_utilization=tuple(gpu[GPU_UTILIZATION]),
        gpu_memory_used_bytes=tuple(gpu[GPU_MEMORY_USED]),
        gpu_memory_total_bytes=tuple(gpu[GPU_MEMORY_TOTAL]),
        summaries_enabled=summaries_enabled,
    )


@dataclass(frozen=True)
class ModelRates:
    """What one model did between two snapshots."""

    seconds: float
    requests: float
    """Requests completed (success + failure)."""
    failures: float
    inferences: float
    executions: float
    request_us: float
    queue_us: float
    compute_infer_us: float
    device_busy_seconds: float
    pending: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None

    @property
    def request_rate(self) -> float:
        return self.requests / self.seconds

    @property
    def average_batch_size(self) -> float | None:
        return self.inferences / self.executions if self.executions else None

    @property
    def queue_ms_per_request(self) -> float | None:
        return self.queue_us / self.requests / 1000 if self.requests else None

    @property
    def latency_ms_per_request(self) -> float | None:
        return self.request_us / self.requests / 1000 if self.requests else None

    @property
    def compute_ms_per_execution(self) -> float | None:
        return self.compute_infer_us / self.executions / 1000 if self.executions else None


def _delta(before: float, after: float) -> float:
    return after if after < before else after - before


def rates(before: Snapshot, after: Snapshot) -> dict[str, ModelRates]:
    """Per-model rates between two snapshots of the same server."""
    seconds = after.taken_at - before.taken_at
    if seconds <= 0:
        return {}
    found = {}
    for model, now in after.models.items():
        then = before.models.get(model, ModelSample(counters={}, pending=0.0))

        def delta(name: str, now: ModelSample = now, then: ModelSample = then) -> float:
            return _delta(then.counter(name), now.counter(name))

        def quantile_ms(q: float, now: ModelSample = now) -> float | None:
            value = now.request_quantiles_us.get(q)
            return value / 1000 if value is not None else None

        found[model] = ModelRates(
            seconds=seconds,
            requests=delta(SUCCESS) + delta(FAILURE),
            failures=delta(FAILURE),
            inferences=delta(INFERENCES),
            executions=delta(EXECUTIONS),
            request_us=delta(REQUEST_US),
            queue_us=delta(QUEUE_US),
            compute_infer_us=delta(COMPUTE_INFER_US),
            device_busy_seconds=delta(EMULATED_DEVICE_BUSY),
            pending=now.pending,
            p50_ms=quantile_ms(0.5),
            p95_ms=quantile_ms(0.95),
            p99_ms=quantile_ms(0.99),
        )
    return found
