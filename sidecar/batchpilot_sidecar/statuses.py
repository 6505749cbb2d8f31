"""What the sidecar knows, as the JSON document /status serves, and its recommendations.

Fits do not depend on any objective; recommendations do, so the caller brings its own:
`/status?sloP95Ms=50&marginMs=5&minDelayUs=100&maxDelayUs=20000` (the operator and the runner
pass their policy's `spec.slo`), falling back to the sidecar's `--slo-p95-ms`.

Latency quantiles come from Triton's summary metrics where it exports them (`--metrics-config
summary_latencies=true`). Without them they are estimated, and the document says so and how:
dynamic batching makes a request wait between nothing and the whole batch-forming time, so the
queue wait is taken as uniform over [0, 2 x its mean], added to the mean of the rest of the
request. That is a model, not a measurement; the load signals built from /status use measured
quantiles only.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from batchpilot_sidecar import collecting, gpus, recommending, steptimes
from batchpilot_triton import __version__, modelconfigs, scraping

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

    def number(name: str) -> float | None:
        text = query.get(name)
        if text is None or text == "":
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{name}={text!r} is not a finite number")
        return value

    slo, margin = number("sloP95Ms"), number("marginMs")
    low, high = number("minDelayUs"), number("maxDelayUs")
    if slo is None and default is None:
        if (margin, low, high) != (None, None, None):
            raise ValueError("marginMs, minDelayUs and maxDelayUs need sloP95Ms")
        return None
    base = default or recommending.Objective(p95_ms=slo or 1.0)
    return recommending.Objective(
        p95_ms=slo if slo is not None else base.p95_ms,
        margin_ms=margin if margin is not None else base.margin_ms,
        min_delay_us=round(low) if low is not None else base.min_delay_us,
        max_delay_us=round(high) if high is not None else base.max_delay_us,
    )


def document(
    collector: collecting.Collector, objective: recommending.Objective | None
) -> dict[str, Any]:
    """The whole /status document."""
    now = collector.clock()
    settings = collector.settings
    return {
        "sidecar": {
            "version": __version__,
            "startedAt": _stamp(collector.started_wall),
            "tritonUrl": collector.triton.url,
            "metricsUrl": collector.triton.metrics_url,
            "intervalSeconds": settings.interval,
            "rateWindowSeconds": settings.rate_window,
            "fitWindowSeconds": settings.fit_window,
            "maxModels": settings.max_models,
            "modelsTracked": len(collector.models),
            "modelsUntracked": collector.untracked,
            "modelsEvicted": collector.evicted,
        },
        "fresh": all(
            not _stale(collector, source, now)
            for source in (collecting.TRITON_METRICS, collecting.TRITON_STATISTICS)
        ),
        "sources": {
            _camel(source): _source(collector, source, now) for source in collecting.SOURCES
        },
        "gpu": _gpu(collector.gpu),
        "objective": _objective(objective),
        "models": {
            name: _model(collector, state, now, objective)
            for name, state in sorted(collector.models.items())
        },
    }


def _stale(collector: collecting.Collector, source: str, now: float) -> bool:
    last = collector.health[source].last_success
    return last is None or now - last > STALE_INTERVALS * collector.settings.interval


def _source(collector: collecting.Collector, source: str, now: float) -> dict[str, Any]:
    health = collector.health[source]
    return {
        "lastSuccessAt": _stamp(health.last_success_wall),
        "ageSeconds": (
            _round(now - health.last_success) if health.last_success is not None else None
        ),
        "stale": _stale(collector, source, now),
        "error": health.last_error,
        "successes": health.successes,
        "failures": health.failures,
    }


def _gpu(telemetry: gpus.GpuTelemetry) -> dict[str, Any]:
    return {
        "status": "available" if telemetry.available else "unavailable",
        "source": telemetry.source,
        "reason": telemetry.reason,
        "devices": [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "utilization": gpu.utilization,
                "memoryUsedBytes": gpu.memory_used_bytes,
                "memoryTotalBytes": gpu.memory_total_bytes,
                "memoryFreeBytes": gpu.memory_free_bytes,
                "powerWatts": gpu.power_watts,
                "powerLimitWatts": gpu.power_limit_watts,
                "smClockMhz": gpu.sm_clock_mhz,
                "temperatureCelsius": gpu.temperature_celsius,
                "problems": list(gpu.problems),
            }
            for gpu in telemetry.gpus
        ],
    }


def _objective(objective: recommending.Objective | None) -> dict[str, Any] | None:
    if objective is None:
        return None
    return {
        "sloP95Ms": objective.p95_ms,
        "marginMs": objective.effective_margin_ms,
        "minDelayUs": objective.min_delay_us,
        "maxDelayUs": objective.max_delay_us,
    }


def _model(
    collector: collecting.Collector,
    state: collecting.ModelState,
    now: float,
    objective: recommending.Objective | None,
) -> dict[str, Any]:
    rates = state.rates(now)
    estimate = latency(rates, summaries_enabled=collector.summaries_enabled)
    found: dict[str, Any] = {
        "lastSeenAgoSeconds": _round(now - state.last_seen),
        "lastActiveAgoSeconds": (
            _round(now - state.last_active) if state.last_active is not None else None
        ),
        "window": _window(rates),
        **_rates(rates),
        "computeMsPerExecution": _round(state.compute_ms_per_execution(now)),
        "latencyMs": {
            **{name: _round(value) for name, value in estimate.quantiles_ms.items()},
            "source": estimate.source,
            "method": estimate.method,
        },
        "config": _config(state.config),
        "configError": state.config_error,
        "stepTime": _step_time(state, now),
    }
    recommendation = recommend(state, now=now, gpu=collector.gpu, objective=objective)
    found["recommendation"] = _recommendation(recommendation)
    return found


def _window(rates: scraping.ModelRates | None) -> dict[str, Any] | None:
    if rates is None:
        return None
    counted = rates.counted
    return {
        "seconds": _round(rates.seconds),
        "requestsSucceeded": counted.requests_succeeded,
        "requestsFailed": counted.requests_failed,
        "inferences": counted.inferences,
        "executions": counted.executions,
        "requestUs": counted.request_us,
        "queueUs": counted.queue_us,
        "computeInferUs": counted.compute_infer_us,
        "pendingRequests": rates.pending,
    }


def _rates(rates: scraping.ModelRates | None) -> dict[str, Any]:
    if rates is None or rates.seconds <= 0:
        return {}
    counted, seconds = rates.counted, rates.seconds
    return {
        "requestRate": _round(counted.requests / seconds),
        "successRate": _round(counted.requests_succeeded / seconds),
        "failureRate": _round(counted.requests_failed / seconds),
        "inferenceRate": _round(counted.inferences / seconds),
        "executionRate": _round(counted.executions / seconds),
        "averageBatchSize": _round(counted.average_batch_size),
        "queueMsPerRequest": _round(counted.queue_ms_per_request),
        "computeMsPerRequest": _round(counted.compute_ms_per_request),
        "pendingRequests": rates.pending,
    }


def _config(config: modelconfigs.ServedBatching | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return {
        "maxBatchSize": config.max_batch_size,
        "maxQueueDelayMicroseconds": config.max_queue_delay_us,
        "preferredBatchSizes": list(config.preferred_batch_sizes),
        "memoryPerItemBytes": config.memory_per_item_bytes,
    }


def _step_time(state: collecting.ModelState, now: float) -> dict[str, Any]:
    fit = state.step_time
    observations = len(state.observations)
    if isinstance(fit, steptimes.NotEnoughData):
        return {
            "status": "insufficient",
            "reason": fit.reason,
            "batchSizes": list(fit.batch_sizes),
            "observations": observations,
            "upToDate": not state.fit_due,
        }
    return {
        "status": "fitted",
        "t0Ms": _round(fit.model.t0_ms),
        "cMs": _round(fit.model.c_ms),
        "alpha": _round(fit.model.alpha),
        "rSquared": _round(fit.r_squared),
        "rmseMs": _round(fit.rmse_ms),
        "batchSizes": list(fit.batch_sizes),
        "span": _round(fit.span),
        "executions": fit.executions,
        "outliers": list(fit.outliers),
        "points": [
            {"batchSize": p.batch_size, "medianMs": _round(p.median_ms), "executions": p.executions}
            for p in fit.points
        ],
        "observations": observations,
        "upToDate": not state.fit_due,
        "fittedAgoSeconds": _round(now - state.fitted_at) if state.fitted_at is not None else None,
    }


def _recommendation(recommendation: Recommendation | str) -> dict[str, Any]:
    if isinstance(recommendation, str):
        return {"status": "unavailable", "reason": recommendation}
    preferred = recommendation.preferred
    delay = recommendation.delay
    return {
        "status": "ok",
        "arrivalRate": _round(recommendation.arrival_rate),
        "preferredBatchSize": preferred.size if preferred else None,
        "preferredBatchReason": preferred.reason if preferred else None,
        "knee": _round(preferred.knee) if preferred else None,
        "memoryCapBatchSize": recommendation.memory_cap,
        "memoryCapReason": recommendation.memory_cap_reason,
        "queueDelay": (
            {
                "status": "ok",
                "microseconds": delay.delay_us,
                "expectedBatchSize": _round(delay.expected_batch),
                "stepMs": _round(delay.step_ms),
                "marginMs": _round(delay.margin_ms),
                "meetsObjective": delay.meets_objective,
                "reason": delay.reason,
            }
            if delay is not None
            else {"status": "unavailable", "reason": recommendation.delay_reason}
        ),
    }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _stamp(wall: float | None) -> str | None:
    if wall is None:
        return None
    instant = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    return instant.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)
