"""Per-model measurements of many servers, reduced to the policy's load signals.

The reductions are the ones `spec.load.rules[].metric` documents: queue depth and request rate
add up over replicas and models, p95 latency is the worst replica's, queue time is weighted by
requests, GPU utilization is the mean over GPUs. A signal with no data is left out rather than
reported as zero, so a rule never fires or lets go on a measurement that was not made.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from batchpilot.policy import decisions
from batchpilot_triton import scraping


def governed(
    per_model: Mapping[str, scraping.ModelRates], models: Collection[str]
) -> list[scraping.ModelRates]:
    """The rates of the models a policy governs; all models when `models` is empty."""
    return [rates for name, rates in per_model.items() if not models or name in models]


def signals_from_rates(
    per_server: Iterable[Mapping[str, scraping.ModelRates]],
    *,
    models: Collection[str],
    gpu_utilization: Sequence[float] = (),
) -> decisions.Signals:
    selected = [rates for per_model in per_server for rates in governed(per_model, models)]
    metrics: dict[str, float] = {}
    if selected:
        metrics["queueDepth"] = sum(rates.pending for rates in selected)
        metrics["requestRate"] = sum(rates.request_rate for rates in selected)
        requests = sum(rates.counted.requests for rates in selected)
        if requests:
            metrics["queueTimeMs"] = (
                sum(rates.counted.queue_us for rates in selected) / requests / 1000
            )
        p95s = [rates.p95_ms for rates in selected if rates.p95_ms is not None]
        if p95s:
            metrics["p95LatencyMs"] = max(p95s)
    if gpu_utilization:
        metrics["gpuUtilization"] = 100 * sum(gpu_utilization) / len(gpu_utilization)
    return decisions.Signals(metrics=metrics)
