"""The Prometheus metrics the sidecar exports: every name and help text, in one place.

Families are built from the collector's state at scrape time rather than kept in Gauge objects,
so a model the sidecar forgets leaves /metrics with it and the exported series stay bounded
like everything else. A value that was not measured is not exported (no zero stands in for it).
The README's metrics table lists the same names; a unit test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchpilot_sidecar import advising, collecting, gpus, llm_recommending, recommending, steptimes
from batchpilot_triton import reports, scraping

PREFIX = "batchpilot_sidecar"


@dataclass(frozen=True)
class Family:
    name: str
    kind: Literal["gauge", "counter"]
    labels: tuple[str, ...]
    help: str


_GPU = ("gpu", "uuid")
_MODEL = ("model",)
FAMILIES = {
    family.name: family
    for family in (
        Family(
            "gpu_available",
            "gauge",
            (),
            "1 when GPU telemetry is available (NVML or DCGM exporter), else 0; /status says why.",
        ),
        Family("gpu_utilization_ratio", "gauge", _GPU, "Fraction of time a kernel ran, 0 to 1."),
        Family(
            "gpu_memory_used_bytes",
            "gauge",
            _GPU,
            "GPU memory in use, without what the driver reserves (as nvidia-smi counts it).",
        ),
        Family("gpu_memory_reserved_bytes", "gauge", _GPU, "GPU memory the driver reserves."),
        Family("gpu_memory_total_bytes", "gauge", _GPU, "GPU memory in all."),
        Family("gpu_power_watts", "gauge", _GPU, "Power draw."),
        Family("gpu_power_limit_watts", "gauge", _GPU, "Enforced power limit."),
        Family("gpu_sm_clock_hertz", "gauge", _GPU, "SM clock."),
        Family("gpu_temperature_celsius", "gauge", _GPU, "GPU temperature."),
        Family("requests_per_second", "gauge", _MODEL, "Requests (succeeded and failed)."),
        Family("request_successes_per_second", "gauge", _MODEL, "Requests that succeeded."),
        Family("request_failures_per_second", "gauge", _MODEL, "Requests that failed."),
        Family("inferences_per_second", "gauge", _MODEL, "Batch items executed."),
        Family("executions_per_second", "gauge", _MODEL, "Batches executed."),
        Family("average_batch_size", "gauge", _MODEL, "Inferences per execution."),
        Family(
            "queue_seconds_per_request", "gauge", _MODEL, "Mean time a request waited in queue."
        ),
        Family("compute_seconds_per_execution", "gauge", _MODEL, "Mean compute time of a batch."),
        Family("pending_requests", "gauge", _MODEL, "Requests waiting to execute, now."),
        Family(
            "request_latency_seconds",
            "gauge",
            ("model", "quantile", "source"),
            "Request latency quantiles; source is summary (Triton's) or estimated (see /status).",
        ),
        Family(
            "step_time_fitted",
            "gauge",
            _MODEL,
            "1 when the step-time model t0 + c*b^alpha is fitted, else 0 (/status says why).",
        ),
        Family("step_time_base_seconds", "gauge", _MODEL, "t0: the fixed cost of a step."),
        Family("step_time_per_item_seconds", "gauge", _MODEL, "c: the cost that grows as b^alpha."),
        Family("step_time_exponent", "gauge", _MODEL, "alpha: how the step grows with the batch."),
        Family(
            "step_time_r_squared",
            "gauge",
            _MODEL,
            "Goodness of the fit (R^2, outliers discounted).",
        ),
        Family("step_time_rmse_seconds", "gauge", _MODEL, "Root-mean-square residual of the fit."),
        Family("step_time_batch_sizes", "gauge", _MODEL, "Distinct batch sizes the fit used."),
        Family(
            "recommended_batch_size",
            "gauge",
            _MODEL,
            "Preferred batch size: the knee of the step-time curve, capped.",
        ),
        Family("memory_batch_cap", "gauge", _MODEL, "Largest batch the free GPU memory allows."),
        Family(
            "recommended_queue_delay_microseconds",
            "gauge",
            _MODEL,
            "Queue delay that meets the --slo-p95-ms objective at the current load.",
        ),
        Family(
            "expected_batch_size",
            "gauge",
            _MODEL,
            "Batch the recommended queue delay makes at the current load.",
        ),
        Family(
            "llm_time_to_first_token_seconds",
            "gauge",
            ("model", "quantile"),
            "An LLM engine's time to first token (p50, p95), measured by the engine.",
        ),
        Family(
            "llm_inter_token_seconds",
            "gauge",
            ("model", "quantile"),
            "An LLM engine's time between two tokens of a request (p50, p95).",
        ),
        Family("llm_output_tokens_per_second", "gauge", _MODEL, "Tokens an LLM engine generated."),
        Family("llm_prompt_tokens_per_second", "gauge", _MODEL, "Prompt tokens it took in."),
        Family("llm_running_sequences", "gauge", _MODEL, "Sequences an LLM engine runs, now."),
        Family("llm_waiting_sequences", "gauge", _MODEL, "Sequences waiting to run, now."),
        Family("llm_kv_cache_usage_ratio", "gauge", _MODEL, "KV-cache in use, 0 to 1."),
        Family(
            "llm_max_num_seqs",
            "gauge",
            _MODEL,
            "Most sequences the vLLM engine runs at once (its max_num_seqs), where known.",
        ),
        Family(
            "llm_step_time_fitted",
            "gauge",
            _MODEL,
            "1 when an LLM engine's step time t0 + c*b^alpha over its running sequences is "
            "fitted, else 0 (/status says why).",
        ),
        Family("llm_step_time_base_seconds", "gauge", _MODEL, "t0 of the engine's step."),
        Family("llm_step_time_per_sequence_seconds", "gauge", _MODEL, "c of the engine's step."),
        Family("llm_step_time_exponent", "gauge", _MODEL, "alpha of the engine's step."),
        Family("llm_step_time_r_squared", "gauge", _MODEL, "Goodness of the engine's step fit."),
        Family(
            "recommended_max_num_seqs",
            "gauge",
            _MODEL,
            "maxNumSeqs whose step keeps inter-token latency within --itl-p95-ms.",
        ),
        Family(
            "recommended_max_num_batched_tokens",
            "gauge",
            _MODEL,
            "maxNumBatchedTokens that keeps time to first token within --ttft-p95-ms.",
        ),
        Family(
            "source_up",
            "gauge",
            ("source",),
            "1 when the last reading of a source (triton_metrics, triton_statistics, gpu) "
            "succeeded.",
        ),
        Family(
            "source_age_seconds",
            "gauge",
            ("source",),
            "Seconds since a source was last read successfully.",
        ),
        Family("source_failures", "counter", ("source",), "Failed readings of a source."),
        Family("models_tracked", "gauge", (), "Models the sidecar keeps windows for."),
        Family(
            "models_untracked",
            "gauge",
            (),
            "Models on Triton's page that the model limit left out.",
        ),
        Family("models_evicted", "counter", (), "Models dropped to make room for busier ones."),
    )
}


def exported_name(family: Family) -> str:
    """The name as it appears on /metrics (counters get `_total`)."""
    suffix = "_total" if family.kind == "counter" else ""
    return f"{PREFIX}_{family.name}{suffix}"


class _Families:
    """Metric families being filled for one scrape."""

    def __init__(self) -> None:
        self.metrics: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, name: str, labels: Iterable[str], value: float | None) -> None:
        if value is None:
            return
        family = FAMILIES[name]
        metric = self.metrics.get(name)
        if metric is None:
            kind = GaugeMetricFamily if family.kind == "gauge" else CounterMetricFamily
            metric = kind(f"{PREFIX}_{name}", family.help, labels=family.labels)
            self.metrics[name] = metric
        metric.add_metric(list(labels), value)


class SidecarCollector(Collector):
    """Renders the collector's state as metric families at every scrape."""

    def __init__(
        self,
        collector: collecting.Collector,
        *,
        objective: Callable[[], recommending.Objective | None],
        llm_objective: Callable[[], llm_recommending.LlmObjective | None] = lambda: None,
    ) -> None:
        self._collector = collector
        self._objective = objective
        self._llm_objective = llm_objective

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        collector = self._collector
        now = collector.clock()
        _gpu_families(families, collector.gpu)
        objective, llm_objective = self._objective(), self._llm_objective()
        for name, state in collector.models.items():
            rates = state.rates(now)
            _model_families(families, collector, name, state, rates, now, objective)
            _llm_families(families, name, state, rates, llm_objective)
        for source, health in collector.health.items():
            families.add(
                "source_up",
                [source],
                1.0 if health.last_error is None and health.successes else 0.0,
            )
            if health.last_success is not None:
                families.add("source_age_seconds", [source], now - health.last_success)
            families.add("source_failures", [source], health.failures)
        families.add("models_tracked", [], len(collector.models))
        families.add("models_untracked", [], collector.untracked)
        families.add("models_evicted", [], collector.evicted)
        yield from families.metrics.values()


def _gpu_families(families: _Families, telemetry: gpus.GpuTelemetry) -> None:
    families.add("gpu_available", [], 1.0 if telemetry.available else 0.0)
    for gpu in telemetry.gpus:
        labels = [str(gpu.index), gpu.uuid or ""]
        families.add("gpu_utilization_ratio", labels, gpu.utilization)
        families.add("gpu_memory_used_bytes", labels, gpu.memory_used_bytes)
        families.add("gpu_memory_reserved_bytes", labels, gpu.memory_reserved_bytes)
        families.add("gpu_memory_total_bytes", labels, gpu.memory_total_bytes)
        families.add("gpu_power_watts", labels, gpu.power_watts)
        families.add("gpu_power_limit_watts", labels, gpu.power_limit_watts)
        clock = gpu.sm_clock_mhz * 1e6 if gpu.sm_clock_mhz is not None else None
        families.add("gpu_sm_clock_hertz", labels, clock)
        families.add("gpu_temperature_celsius", labels, gpu.temperature_celsius)


def _model_families(
    families: _Families,
    collector: collecting.Collector,
    name: str,
    state: collecting.ModelState,
    rates: scraping.ModelRates | None,
    now: float,
    objective: recommending.Objective | None,
) -> None:
    model = [name]
    if rates is not None and rates.seconds > 0:
        counted, seconds = rates.counted, rates.seconds
        families.add("requests_per_second", model, counted.requests / seconds)
        families.add("request_successes_per_second", model, counted.requests_succeeded / seconds)
        families.add("request_failures_per_second", model, counted.requests_failed / seconds)
        families.add("inferences_per_second", model, counted.inferences / seconds)
        families.add("executions_per_second", model, counted.executions / seconds)
        families.add("average_batch_size", model, counted.average_batch_size)
        queue_ms = counted.queue_ms_per_request
        families.add("queue_seconds_per_request", model, _seconds(queue_ms))
        families.add("pending_requests", model, rates.pending)
    families.add(
        "compute_seconds_per_execution", model, _seconds(state.compute_ms_per_execution(now))
    )
    latency = advising.latency(rates, summaries_enabled=collector.summaries_enabled)
    for quantile_name, value in latency.quantiles_ms.items():
        quantile = str(advising.QUANTILES[quantile_name])
        families.add("request_latency_seconds", [name, quantile, latency.source], value / 1000)
    fit = state.step_time
    families.add("step_time_fitted", model, 1.0 if isinstance(fit, steptimes.Fit) else 0.0)
    if isinstance(fit, steptimes.Fit):
        families.add("step_time_base_seconds", model, fit.model.t0_ms / 1000)
        families.add("step_time_per_item_seconds", model, fit.model.c_ms / 1000)
        families.add("step_time_exponent", model, fit.model.alpha)
        families.add("step_time_r_squared", model, fit.r_squared)
        families.add("step_time_rmse_seconds", model, fit.rmse_ms / 1000)
        families.add("step_time_batch_sizes", model, len(fit.batch_sizes))
    recommendation = advising.recommend(state, now=now, gpu=collector.gpu, objective=objective)
    if isinstance(recommendation, advising.Recommendation):
        if recommendation.preferred is not None:
            families.add("recommended_batch_size", model, recommendation.preferred.size)
        families.add("memory_batch_cap", model, recommendation.memory_cap)
        if recommendation.delay is not None:
            delay = recommendation.delay
            families.add("recommended_queue_delay_microseconds", model, delay.delay_us)
            families.add("expected_batch_size", model, delay.expected_batch)


def _llm_families(
    families: _Families,
    name: str,
    state: collecting.ModelState,
    rates: scraping.ModelRates | None,
    objective: llm_recommending.LlmObjective | None,
) -> None:
    """What /status shows under `models.<m>.llm`, for a model served by an LLM engine."""
    model = [name]
    measured = reports.LlmReport.from_rates(rates)
    if measured is None:
        return
    for quantile, ttft_ms, itl_ms in (
        ("0.5", measured.ttft_p50_ms, measured.inter_token_p50_ms),
        ("0.95", measured.ttft_p95_ms, measured.inter_token_p95_ms),
    ):
        families.add("llm_time_to_first_token_seconds", [name, quantile], _seconds(ttft_ms))
        families.add("llm_inter_token_seconds", [name, quantile], _seconds(itl_ms))
    families.add("llm_output_tokens_per_second", model, measured.output_tokens_per_second)
    families.add("llm_prompt_tokens_per_second", model, measured.prompt_tokens_per_second)
    families.add("llm_running_sequences", model, measured.running_sequences)
    families.add("llm_waiting_sequences", model, measured.waiting_sequences)
    families.add("llm_kv_cache_usage_ratio", model, measured.kv_cache_usage)
    families.add("llm_max_num_seqs", model, state.config.max_num_seqs if state.config else None)
    fit = state.decode_step_time
    families.add("llm_step_time_fitted", model, 1.0 if isinstance(fit, steptimes.Fit) else 0.0)
    if isinstance(fit, steptimes.Fit):
        families.add("llm_step_time_base_seconds", model, fit.model.t0_ms / 1000)
        families.add("llm_step_time_per_sequence_seconds", model, fit.model.c_ms / 1000)
        families.add("llm_step_time_exponent", model, fit.model.alpha)
        families.add("llm_step_time_r_squared", model, fit.r_squared)
    recommendation = advising.recommend_llm(state, rates, objective)
    if recommendation.max_num_seqs is not None:
        families.add("recommended_max_num_seqs", model, recommendation.max_num_seqs.value)
    if recommendation.max_num_batched_tokens is not None:
        tokens = recommendation.max_num_batched_tokens.value
        families.add("recommended_max_num_batched_tokens", model, tokens)


def _seconds(milliseconds: float | None) -> float | None:
    return milliseconds / 1000 if milliseconds is not None else None


def registry(
    collector: collecting.Collector,
    *,
    objective: Callable[[], recommending.Objective | None],
    llm_objective: Callable[[], llm_recommending.LlmObjective | None] = lambda: None,
) -> CollectorRegistry:
    """A registry with the sidecar's families only (no process or platform collectors)."""
    found = CollectorRegistry()
    found.register(SidecarCollector(collector, objective=objective, llm_objective=llm_objective))
    return found
