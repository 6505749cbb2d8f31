"""What the sidecar knows, as the JSON document /status serves: its sources, the GPU, each
model's window, served configuration, step-time fit, and the advice (`advising`) for the
caller's objective."""

from __future__ import annotations

import dataclasses
import datetime

from batchpilot_sidecar import advising, collecting, gpus, llm_recommending, recommending, steptimes
from batchpilot_triton import __version__, modelconfigs, reports, scraping

STALE_INTERVALS = 3
"""A source is stale once it has not been read for this many intervals."""


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
            advising.rounded(now - health.last_success) if health.last_success is not None else None
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
                memory_reserved_bytes=gpu.memory_reserved_bytes,
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
    estimate = advising.latency(rates, summaries_enabled=collector.summaries_enabled)
    quantiles = {name: advising.rounded(value) for name, value in estimate.quantiles_ms.items()}
    measured = rates is not None and rates.seconds > 0
    counted = rates.counted if rates is not None else None
    seconds = rates.seconds if rates is not None else 0.0

    def per_second(value: float | None) -> float | None:
        return advising.rounded(value / seconds) if measured and value is not None else None

    return reports.ModelReport(
        last_seen_ago_seconds=advising.rounded(now - state.last_seen),
        last_active_ago_seconds=(
            advising.rounded(now - state.last_active) if state.last_active is not None else None
        ),
        window=_window(rates),
        request_rate=per_second(counted.requests if counted else None),
        success_rate=per_second(counted.requests_succeeded if counted else None),
        failure_rate=per_second(counted.requests_failed if counted else None),
        inference_rate=per_second(counted.inferences if counted else None),
        execution_rate=per_second(counted.executions if counted else None),
        average_batch_size=advising.rounded(counted.average_batch_size)
        if measured and counted
        else None,
        queue_ms_per_request=advising.rounded(counted.queue_ms_per_request)
        if measured and counted
        else None,
        compute_ms_per_request=(
            advising.rounded(counted.compute_ms_per_request) if measured and counted else None
        ),
        pending_requests=rates.pending if measured and rates else None,
        compute_ms_per_execution=advising.rounded(state.compute_ms_per_execution(now)),
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
            advising.recommend(state, now=now, gpu=collector.gpu, objective=objective)
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
        recommendation=advising.recommend_llm(state, rates, objective),
    )


def _window(rates: scraping.ModelRates | None) -> reports.Window | None:
    if rates is None:
        return None
    counted = rates.counted
    return reports.Window(
        seconds=advising.rounded(rates.seconds) or 0.0,
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
        t0_ms=advising.rounded(fit.model.t0_ms),
        c_ms=advising.rounded(fit.model.c_ms),
        alpha=advising.rounded(fit.model.alpha),
        r_squared=advising.rounded(fit.r_squared),
        rmse_ms=advising.rounded(fit.rmse_ms),
        batch_sizes=tuple(fit.batch_sizes),
        span=advising.rounded(fit.span),
        executions=fit.executions,
        outliers=tuple(fit.outliers),
        points=tuple(
            reports.FitPoint(
                batch_size=p.batch_size,
                median_ms=advising.rounded(p.median_ms),
                executions=p.executions,
            )
            for p in fit.points
        ),
        observations=observations,
        up_to_date=up_to_date,
        fitted_ago_seconds=advising.rounded(now - fitted_at) if fitted_at is not None else None,
    )


def _recommendation(recommendation: advising.Recommendation | str) -> reports.RecommendationReport:
    if isinstance(recommendation, str):
        return reports.RecommendationReport(status="unavailable", reason=recommendation)
    preferred = recommendation.preferred
    delay = recommendation.delay
    return reports.RecommendationReport(
        status="ok",
        arrival_rate=advising.rounded(recommendation.arrival_rate),
        preferred_batch_size=preferred.size if preferred else None,
        preferred_batch_reason=preferred.reason if preferred else None,
        knee=advising.rounded(preferred.knee) if preferred else None,
        memory_cap_batch_size=recommendation.memory_cap,
        memory_cap_reason=recommendation.memory_cap_reason,
        queue_delay=(
            reports.QueueDelayReport(
                status="ok",
                microseconds=delay.delay_us,
                expected_batch_size=advising.rounded(delay.expected_batch),
                step_ms=advising.rounded(delay.step_ms),
                margin_ms=advising.rounded(delay.margin_ms),
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
