"""The sidecar's advice: latency as Triton reports it (or as estimated without its summaries),
and the recommendations for a caller's objective, from what the collector holds.

Fits do not depend on any objective; recommendations do, so the caller brings its own:
`/status?sloP95Ms=50&marginMs=5&minDelayUs=100&maxDelayUs=20000` (the operator and the runner
pass their policy's `spec.slo`), falling back to the sidecar's `--slo-p95-ms`; for LLM engines
`ttftP95Ms=500&itlP95Ms=50`, falling back to `--ttft-p95-ms` and `--itl-p95-ms`.

Latency quantiles come from Triton's summary metrics where it exports them (`--metrics-config
summary_latencies=true`). Without them they are estimated, and the document says so and how:
dynamic batching makes a request wait between nothing and the whole batch-forming time, so the
queue wait is taken as uniform over [0, 2 x its mean], added to the mean of the rest of the
request. That is a model, not a measurement; the load signals built from /status use measured
quantiles only. Both /status (`status_document`) and /metrics (`telemetry`) serve this advice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from batchpilot_sidecar import collecting, gpus, llm_recommending, recommending, steptimes
from batchpilot_triton import modelconfigs, reports, scraping

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
        mean_prompt_tokens=rounded(mean_prompt),
        prompt_tokens_per_second=rounded(prompt_rate),
        max_num_seqs=seqs_report,
        max_num_batched_tokens=tokens_report,
    )


def _limit(limit: llm_recommending.Limit) -> reports.EngineLimitReport:
    return reports.EngineLimitReport(
        status="ok",
        reason=limit.reason,
        value=limit.value,
        step_ms=rounded(limit.step_ms),
        margin_ms=rounded(limit.margin_ms),
        meets_objective=limit.meets_objective,
    )


def rounded(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)
