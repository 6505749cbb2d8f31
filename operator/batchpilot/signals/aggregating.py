"""Per-model measurements of many servers, reduced to the policy's load signals.

The reductions are the ones `spec.load.rules[].metric` documents: queue depth and request rate
add up over replicas and models, p95 latency is the worst replica's, queue time is weighted by
requests, GPU utilization is the mean over GPUs. An LLM engine's figures reduce the same way:
its TTFT and inter-token p95s are the worst replica's, output tokens per second and waiting
sequences add up. They arrive as the sidecar reports them (`reports.LlmReport`), which Triton's
own pages give too (`engine_reports`), so both sources reduce them with one function. A signal
with no data is left out rather than reported as zero, so a rule never fires or lets go on a
measurement that was not made.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TypeVar

from batchpilot.policy import decisions
from batchpilot_triton import reports, scraping

PerModel = TypeVar("PerModel")


def governed(per_model: Mapping[str, PerModel], models: Collection[str]) -> list[PerModel]:
    """The figures of the models a policy governs; all models when `models` is empty."""
    return [figures for name, figures in per_model.items() if not models or name in models]


def engine_reports(per_model: Mapping[str, scraping.ModelRates]) -> dict[str, reports.LlmReport]:
    """What the LLM engines behind these models counted, as their sidecar would report it."""
    found = {name: reports.LlmReport.from_rates(rates) for name, rates in per_model.items()}
    return {name: report for name, report in found.items() if report is not None}


def signals_from_rates(
    per_server: Iterable[Mapping[str, scraping.ModelRates]],
    *,
    models: Collection[str],
    gpu_utilization: Sequence[float] = (),
    engines: Iterable[Mapping[str, reports.LlmReport]] = (),
) -> decisions.Signals:
    """The load signals of the governed models; `engines` are, per server, the models served
    by an LLM engine."""
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
    metrics.update(
        _engine_signals([report for per_model in engines for report in governed(per_model, models)])
    )
    return decisions.Signals(metrics=metrics)


def _engine_signals(selected: Sequence[reports.LlmReport]) -> dict[str, float]:
    if not selected:
        return {}
    metrics = {
        "outputTokensPerSecond": sum(report.output_tokens_per_second for report in selected),
        "waitingSequences": sum(report.waiting_sequences for report in selected),
    }
    # A model without a first token (or a second) in the window has no quantile to compare.
    worst = {
        "ttftP95Ms": [report.ttft_p95_ms for report in selected],
        "interTokenP95Ms": [report.inter_token_p95_ms for report in selected],
    }
    for name, p95s in worst.items():
        measured = [p95 for p95 in p95s if p95 is not None]
        if measured:
            metrics[name] = max(measured)
    return metrics
