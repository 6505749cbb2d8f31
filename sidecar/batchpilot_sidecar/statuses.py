"""What the sidecar knows, as the JSON document /status serves, and its recommendations.

Fits do not depend on any objective; recommendations do, so the caller brings its own:
`/status?sloP95Ms=50&marginMs=5&minDelayUs=100&maxDelayUs=20000` (the operator and the runner
pass their policy's `spec.slo`), falling back to the sidecar's `--slo-p95-ms`; for LLM engines
`ttftP95Ms=500&itlP95Ms=50`, falling back to `--ttft-p95-ms` and `--itl-p95-ms`.

Latency quantiles come from Triton's summary metrics where it exports them (`--metrics-config
summary_latencies=true`). Without them they are estimated, and the document says so and how:
dynamic batching makes a request wait between nothing and the whole batch-forming time, so the
queue wait is taken as uniform over [0, 2 x its mean], added to the mean of the rest of the
request. That is a model, not a measurement; the load signals built from /status use measured
quantiles only.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from batchpilot_sidecar import collecting, gpus, llm_recommending, recommending, steptimes
from batchpilot_triton import __version__, modelconfigs, reports, scraping

STALE_INTERVALS = 3
"""A source is stale once it has not been read for this many intervals."""
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}

LatencySource = Literal["summary", "estimated", "none"]


@dataclass(frozen=True, kw_only=True)
class Latency:
    quantiles_ms: Mapping[str, float]
    source: LatencySource
    method: str


def latency(rates: scraping.ModelRates | None, *, summaries_enabled: bool | None) -> Latency:
    measured = (
        {
            name: value
            for name, value in (("p50", rates.p50_ms), ("p95", rates.p95_ms), ("p99", rates.p99_ms))
            if value is not None
        }
        if rates is not None
        else {}
    )
    if measured:
        return Latency(
            quantiles_ms=measured,
            source="summary",
            method="Triton's summary metrics (nv_inference_request_summary_us)",
        )
    if rates is None or not rates.counted.requests:
        return Latency(quantiles_ms={}, source="none", method="no requests in the rate window")
    queue_ms = rates.counted.queue_us / rates.counted.requests / 1000
    mean_ms = rates.counted.request_us / rates.counted.requests / 1000
    why = (
        "summaries are off (start Triton with --metrics-config summary_latencies=true)"
        if not summaries_enabled
        else "the summary has no quantiles yet"
    )
    return Latency(
        # Uniform wait over [0, 2q]: the q-quantile is 2q*mean_queue, the rest is the mean.
        quantiles_ms={name: mean_ms - queue_ms + 2 * q * queue_ms for name, q in QUANTILES.items()},
        source="estimated",
        method=f"estimated, {why}: queue wait taken as uniform over [0, 2 x mean queue time] "
        "plus the mean of the rest of the request duration",
    )


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    preferred: recommending.PreferredBatch | None
    memory_cap: int | None
    memory_cap_reason: str
    delay: recommending.DelayRecommendation | None
    """None when no objective is given or something it needs is missing; `delay_reason` says."""
    delay_reason: str
    arrival_rate: float | None
    """Inferences (batch items) per second over the rate window."""


def recommend(
    state: collecting.ModelState,
    *,
    now: float,
    gpu: gpus.GpuTelemetry,
    objective: recommending.Objective | None,
) -> Recommendation | str:
    """The recommendations for one model, or why there are none."""
    fit = state.step_time
    if isinstance(fit, steptimes.NotEnoughData):
        return f"step time not fitted: {fit.reason}"
    config = state.config
    if config is None:
        return f"model config not read: {state.config_error or 'not yet'}"
    if config.max_batch_size < 1:
        return "the model does not batch (max_batch_size 0)"
    cap, cap_reason = _memory_cap(config, gpu)
    preferred = recommending.preferred_batch(
        fit.model, max_batch=config.max_batch_size, memory_cap=cap
    )
    rates = state.rates(now)
    arrival = rates.counted.inferences / rates.seconds if rates and rates.seconds > 0 else None
    delay: recommending.DelayRecommendation | None = None
    if objective is None:
        delay_reason = "no objective: pass sloP95Ms (and marginMs, minDelayUs, maxDelayUs)"
    elif arrival is None:
        delay_reason = "no arrival rate measured yet"
    else:
        # Triton's batcher knows nothing of the memory cap: batches grow to max_batch_size.
        delay = recommending.queue_delay(
            fit.model, objective, rate_per_second=arrival, max_batch=config.max_batch_size
        )
        delay_reason = delay.reason
    return Recommendation(
        preferred=preferred,
        memory_cap=cap,
        memory_cap_reason=cap_reason,
        delay=delay,
        delay_reason=delay_reason,
        arrival_rate=arrival,
    )


def _memory_cap(
    config: modelconfigs.ServedBatching, gpu: gpus.GpuTelemetry
) -> tuple[int | None, str]:
    if config.memory_per_item_bytes is None:
        return None, f"declare parameter {modelconfigs.MEMORY_PER_ITEM_PARAMETER} for a memory cap"
    free = gpu.least_free_memory()
    if free is None:
        return None, f"free GPU memory unknown: {gpu.reason or 'not reported by every GPU'}"
    cap = recommending.memory_cap(free_bytes=free, bytes_per_item=config.memory_per_item_bytes)
    return cap, (
        f"{recommending.MEMORY_HEADROOM:.0%} of {free / 2**20:.0f} MiB free on the fullest GPU "
        f"at {config.memory_per_item_bytes / 2**20:.3g} MiB per item"
    )


def parse_objective(
    query: Mapping[str, str], default: recommending.Objective | None
) -> recommending.Objective | None:
    """The objective a /status query asks for; parameters it leaves out come from `default`."""
    asked = reports.ObjectiveQuery.from_query(query)
    if asked.slo_p95_ms is None and default is None:
        if (asked.margin_ms, asked.min_delay_us, asked.max_delay_us) != (None, None, None):
            raise ValueError(
                f"{reports.MARGIN_MS}, {reports.MIN_DELAY_US} and {reports.MAX_DELAY_US} "
                f"need {reports.SLO_P95_MS}"
            )
        return None
    base = default or recommending.Objective(p95_ms=asked.slo_p95_ms or 1.0)
    return recommending.Objective(
        p95_ms=asked.slo_p95_ms if asked.slo_p95_ms is not None else base.p95_ms,
        margin_ms=asked.margin_ms if asked.margin_ms is not None else base.margin_ms,
        min_delay_us=asked.min_delay_us if asked.min_delay_us is not None else base.min_delay_us,
        max_delay_us=asked.max_delay_us if asked.max_delay_us is not None else base.max_delay_us,
    )


def parse_llm_objective(
    query: Mapping[str, str], default: llm_recommending.LlmObjective | None
) -> llm_recommending.LlmObjective | None:
    """The LLM objectives a /status query asks for; those it leaves out come from `default`."""
    asked = reports.ObjectiveQuery.from_query(query)
    ttft, itl = asked.ttft_p95_ms, asked.itl_p95_ms
    if default is not None:
        ttft = ttft if ttft is not None else default.ttft_p95_ms
        itl = itl if itl is not None else default.itl_p95_ms
    objective = llm_recommending.LlmObjective(ttft_p95_ms=ttft, itl_p95_ms=itl)
    return objective if objective.given else None


def recommend_llm(
    state: collecting.ModelState,
    rates: scraping.ModelRates | None,
    objective: llm_recommending.LlmObjective | None,
) -> reports.LlmRecommendationReport:
    """maxNumSeqs and maxNumBatchedTokens for an LLM engine's objectives, or why there are none."""
    if objective is None:
        return reports.LlmRecommendationReport(
            status="unavailable",
            reason=f"no objective: pass {reports.TTFT_P95_MS} or {reports.ITL_P95_MS}",
        )
    used = reports.LlmObjectiveReport(
        ttft_p95_ms=objective.ttft_p95_ms,
        itl_p95_ms=objective.itl_p95_ms,
        margin_fraction=llm_recommending.MARGIN_FRACTION,
    )
    fit = state.decode_step_time
    if isinstance(fit, steptimes.NotEnoughData):
        return reports.LlmRecommendationReport(
            status="unavailable", reason=f"step time not fitted: {fit.reason}", objective=used
        )
    most_running = fit.batch_sizes[-1]
    seqs: llm_recommending.Limit | None = None
    if objective.itl_p95_ms is not None:
        seqs = llm_recommending.max_num_seqs(
            fit.model, itl_p95_ms=objective.itl_p95_ms, most_running_seen=most_running
        )
        seqs_report = _limit(seqs)
    else:
        seqs_report = reports.EngineLimitReport(
            status="unavailable", reason=f"no {reports.ITL_P95_MS} objective"
        )
    running = seqs.value if seqs is not None else most_running
    engine = rates.engine if rates is not None else None
    prompts = engine.time_to_first_token.count if engine is not None else 0.0
    mean_prompt = engine.prompt_tokens / prompts if engine is not None and prompts > 0 else None
    prompt_rate = (
        engine.prompt_tokens / rates.seconds
        if engine is not None and rates is not None and rates.seconds > 0
        else None
    )
    if objective.ttft_p95_ms is None:
        tokens_report = reports.EngineLimitReport(
            status="unavailable", reason=f"no {reports.TTFT_P95_MS} objective"
        )
    elif mean_prompt is None or prompt_rate is None:
        tokens_report = reports.EngineLimitReport(
            status="unavailable", reason="no prompts measured in the rate window"
        )
    else:
        tokens_report = _limit(
            llm_recommending.max_num_batched_tokens(
                fit.model,
                ttft_p95_ms=objective.ttft_p95_ms,
                running=running,
                prompt_tokens=mean_prompt,
                prompt_tokens_per_second=prompt_rate,
            )
        )
    return reports.LlmRecommendationReport(
        status="ok",
        objective=used,
        assumed_running_sequences=running,
        mean_prompt_tokens=_round(mean_prompt),
        prompt_tokens_per_second=_round(prompt_rate),
        max_num_seqs=seqs_report,
        max_num_batched_tokens=tokens_report,
    )


def _limit(limit: llm_recommending.Limit) -> reports.EngineLimitReport:
    return reports.EngineLimitReport(
        status="ok",
        reason=limit.reason,
        value=limit.value,
        step_ms=_round(limit.step_ms),
        margin_ms=_round(limit.margin_ms),
        meets_objective=limit.meets_objective,
    )


def document(
    collector: collecting.Collector,
    objective: recommending.Objective | None,
    llm_objective: llm_recommending.LlmObjective | None = None,
) -> reports.StatusDocument:
    """The whole /status document."""
    now = collector.clock()
    settings = collector.settings
    return reports.StatusDocument(
        sidecar=reports.SidecarInfo(
            version=__version__,
            started_at=_stamp(collector.started_wall),
            triton_url=collector.triton.url,
            metrics_url=collector.triton.metrics_url,
            interval_seconds=settings.interval,
            rate_window_seconds=settings.rate_window,
            fit_window_seconds=settings.fit_window,
            max_models=settings.max_models,
            models_tracked=len(collector.models),
            models_untracked=collector.untracked,
            models_evicted=collector.evicted,
        ),
        fresh=all(
            not _stale(collector, source, now)
            for source in (collecting.TRITON_METRICS, collecting.TRITON_STATISTICS)
        ),
        sources=reports.Sources(
            triton_metrics=_source(collector, collecting.TRITON_METRICS, now),
            triton_statistics=_source(collector, collecting.TRITON_STATISTICS, now),
            gpu=_source(collector, collecting.GPU, now),
        ),
        gpu=_gpu(collector.gpu),
        objective=_objective(objective),
        models={
            name: _model(collector, state, now, objective, llm_objective)
            for name, state in sorted(collector.models.items())
        },
    )


def _stale(collector: collecting.Collector, source: str, now: float) -> bool:
    last = collector.health[source].last_success
    return last is None or now - last > STALE_INTERVALS * collector.settings.interval


def _source(collector: collecting.Collector, source: str, now: float) -> reports.SourceReport:
    health = collector.health[source]
    return reports.SourceReport(
        last_success_at=_stamp(health.last_success_wall),
        age_seconds=(
            _round(now - health.last_success) if health.last_success is not None else None
        ),
        stale=_stale(collector, source, now),
        error=health.last_error,
        successes=health.successes,
        failures=health.failures,
    )


def _gpu(telemetry: gpus.GpuTelemetry) -> reports.GpuReport:
    return reports.GpuReport(
        status="available" if telemetry.available else "unavailable",
        source=telemetry.source,
        reason=telemetry.reason,
        devices=tuple(
            reports.DeviceReport(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                utilization=gpu.utilization,
                memory_used_bytes=gpu.memory_used_bytes,
                memory_total_bytes=gpu.memory_total_bytes,
                memory_free_bytes=gpu.memory_free_bytes,
                power_watts=gpu.power_watts,
                power_limit_watts=gpu.power_limit_watts,
                sm_clock_mhz=gpu.sm_clock_mhz,
                temperature_celsius=gpu.temperature_celsius,
                problems=tuple(gpu.problems),
            )
            for gpu in telemetry.gpus
        ),
    )


def _objective(objective: recommending.Objective | None) -> reports.ObjectiveReport | None:
    if objective is None:
        return None
    return reports.ObjectiveReport(
        slo_p95_ms=objective.p95_ms,
        margin_ms=objective.effective_margin_ms,
        min_delay_us=objective.min_delay_us,
        max_delay_us=objective.max_delay_us,
    )


def _model(
    collector: collecting.Collector,
    state: collecting.ModelState,
    now: float,
    objective: recommending.Objective | None,
    llm_objective: llm_recommending.LlmObjective | None,
) -> reports.ModelReport:
    rates = state.rates(now)
    estimate = latency(rates, summaries_enabled=collector.summaries_enabled)
    quantiles = {name: _round(value) for name, value in estimate.quantiles_ms.items()}
    measured = rates is not None and rates.seconds > 0
    counted = rates.counted if rates is not None else None
    seconds = rates.seconds if rates is not None else 0.0

    def per_second(value: float | None) -> float | None:
        return _round(value / seconds) if measured and value is not None else None

    return reports.ModelReport(
        last_seen_ago_seconds=_round(now - state.last_seen),
        last_active_ago_seconds=(
            _round(now - state.last_active) if state.last_active is not None else None
        ),
        window=_window(rates),
        request_rate=per_second(counted.requests if counted else None),
        success_rate=per_second(counted.requests_succeeded if counted else None),
        failure_rate=per_second(counted.requests_failed if counted else None),
        inference_rate=per_second(counted.inferences if counted else None),
        execution_rate=per_second(counted.executions if counted else None),
        average_batch_size=_round(counted.average_batch_size) if measured and counted else None,
        queue_ms_per_request=_round(counted.queue_ms_per_request) if measured and counted else None,
        compute_ms_per_request=(
            _round(counted.compute_ms_per_request) if measured and counted else None
        ),
        pending_requests=rates.pending if measured and rates else None,
        compute_ms_per_execution=_round(state.compute_ms_per_execution(now)),
        latency_ms=reports.LatencyReport(
            p50=quantiles.get("p50"),
            p95=quantiles.get("p95"),
            p99=quantiles.get("p99"),
            source=estimate.source,
            method=estimate.method,
        ),
        config=_config(state.config),
        config_error=state.config_error,
        step_time=_step_time(state, now),
        recommendation=_recommendation(
            recommend(state, now=now, gpu=collector.gpu, objective=objective)
        ),
        llm=_llm(state, rates, now, llm_objective),
    )


def _llm(
    state: collecting.ModelState,
    rates: scraping.ModelRates | None,
    now: float,
    objective: llm_recommending.LlmObjective | None,
) -> reports.LlmReport | None:
    """What the engine counted (as every source reads it), with this sidecar's step-time fit
    and recommendation."""
    measured = reports.LlmReport.from_rates(rates)
    if measured is None:
        return None
    return dataclasses.replace(
        measured,
        step_time=_fit_report(
            state.decode_step_time,
            observations=len(state.decode_samples),
            up_to_date=not state.fit_due,
            fitted_at=state.fitted_at,
            now=now,
        ),
        recommendation=recommend_llm(state, rates, objective),
    )


def _window(rates: scraping.ModelRates | None) -> reports.Window | None:
    if rates is None:
        return None
    counted = rates.counted
    return reports.Window(
        seconds=_round(rates.seconds) or 0.0,
        requests_succeeded=counted.requests_succeeded,
        requests_failed=counted.requests_failed,
        inferences=counted.inferences,
        executions=counted.executions,
        request_us=counted.request_us,
        queue_us=counted.queue_us,
        compute_infer_us=counted.compute_infer_us,
        pending_requests=rates.pending,
    )


def _config(config: modelconfigs.ServedBatching | None) -> reports.ConfigReport | None:
    if config is None:
        return None
    return reports.ConfigReport(
        max_batch_size=config.max_batch_size,
        max_queue_delay_microseconds=config.max_queue_delay_us,
        preferred_batch_sizes=config.preferred_batch_sizes,
        memory_per_item_bytes=config.memory_per_item_bytes,
        max_num_seqs=config.max_num_seqs,
    )


def _step_time(state: collecting.ModelState, now: float) -> reports.StepTimeReport:
    return _fit_report(
        state.step_time,
        observations=len(state.observations),
        up_to_date=not state.fit_due,
        fitted_at=state.fitted_at,
        now=now,
    )


def _fit_report(
    fit: steptimes.Fit | steptimes.NotEnoughData,
    *,
    observations: int,
    up_to_date: bool,
    fitted_at: float | None,
    now: float,
) -> reports.StepTimeReport:
    if isinstance(fit, steptimes.NotEnoughData):
        return reports.StepTimeReport(
            status="insufficient",
            reason=fit.reason,
            batch_sizes=tuple(fit.batch_sizes),
            observations=observations,
            up_to_date=up_to_date,
        )
    return reports.StepTimeReport(
        status="fitted",
        t0_ms=_round(fit.model.t0_ms),
        c_ms=_round(fit.model.c_ms),
        alpha=_round(fit.model.alpha),
        r_squared=_round(fit.r_squared),
        rmse_ms=_round(fit.rmse_ms),
        batch_sizes=tuple(fit.batch_sizes),
        span=_round(fit.span),
        executions=fit.executions,
        outliers=tuple(fit.outliers),
        points=tuple(
            reports.FitPoint(
                batch_size=p.batch_size, median_ms=_round(p.median_ms), executions=p.executions
            )
            for p in fit.points
        ),
        observations=observations,
        up_to_date=up_to_date,
        fitted_ago_seconds=_round(now - fitted_at) if fitted_at is not None else None,
    )


def _recommendation(recommendation: Recommendation | str) -> reports.RecommendationReport:
    if isinstance(recommendation, str):
        return reports.RecommendationReport(status="unavailable", reason=recommendation)
    preferred = recommendation.preferred
    delay = recommendation.delay
    return reports.RecommendationReport(
        status="ok",
        arrival_rate=_round(recommendation.arrival_rate),
        preferred_batch_size=preferred.size if preferred else None,
        preferred_batch_reason=preferred.reason if preferred else None,
        knee=_round(preferred.knee) if preferred else None,
        memory_cap_batch_size=recommendation.memory_cap,
        memory_cap_reason=recommendation.memory_cap_reason,
        queue_delay=(
            reports.QueueDelayReport(
                status="ok",
                microseconds=delay.delay_us,
                expected_batch_size=_round(delay.expected_batch),
                step_ms=_round(delay.step_ms),
                margin_ms=_round(delay.margin_ms),
                meets_objective=delay.meets_objective,
                reason=delay.reason,
            )
            if delay is not None
            else reports.QueueDelayReport(status="unavailable", reason=recommendation.delay_reason)
        ),
    )


def _stamp(wall: float | None) -> str | None:
    if wall is None:
        return None
    instant = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    return instant.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)
