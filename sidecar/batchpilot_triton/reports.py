"""The sidecar's `/status` document: one typed model that the sidecar writes and the operator and
the runner read, and the query that asks a sidecar for recommendations under an objective.

The classes are plain frozen dataclasses, so the sidecar serialises them (`as_json`) without a
validation library; readers validate a document against the same classes (pydantic understands
them: each carries its settings in `__pydantic_config__`, camelCase field names on the wire,
unknown fields ignored so that an older reader accepts a newer sidecar). A field that does not
apply is null, never missing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Literal

from batchpilot_triton import engine_metrics, scraping

SourceName = Literal["tritonMetrics", "tritonStatistics", "gpu"]
LatencySource = Literal["summary", "estimated", "none"]


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_WIRE = {"alias_generator": camel, "extra": "ignore"}


def _rounded(value: float | None, digits: int = 4) -> float | None:
    """No more digits than a reader needs; a value that is not finite is no value."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def as_json(report: Any) -> Any:
    """A report as JSON-ready data: dataclasses become objects with camelCase keys; the keys of
    plain mappings (model names) stay as they are."""
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return {
            camel(field.name): as_json(getattr(report, field.name))
            for field in dataclasses.fields(report)
        }
    if isinstance(report, Mapping):
        return {key: as_json(value) for key, value in report.items()}
    if isinstance(report, list | tuple):
        return [as_json(item) for item in report]
    return report


# The recommendation query: `/status?sloP95Ms=50&marginMs=5&minDelayUs=100&maxDelayUs=20000`,
# and for LLM engines `ttftP95Ms=500&itlP95Ms=50`.
SLO_P95_MS = "sloP95Ms"
MARGIN_MS = "marginMs"
MIN_DELAY_US = "minDelayUs"
MAX_DELAY_US = "maxDelayUs"
TTFT_P95_MS = "ttftP95Ms"
ITL_P95_MS = "itlP95Ms"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveQuery:
    """The latency objectives a caller brings to `/status`; a missing value takes the sidecar's
    default (`--slo-p95-ms`, `--ttft-p95-ms`, `--itl-p95-ms`, then the built-in margin and delay
    bounds)."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    slo_p95_ms: float | None = None
    margin_ms: float | None = None
    min_delay_us: int | None = None
    max_delay_us: int | None = None
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None

    def to_query(self) -> dict[str, str]:
        values = {
            SLO_P95_MS: self.slo_p95_ms,
            MARGIN_MS: self.margin_ms,
            MIN_DELAY_US: self.min_delay_us,
            MAX_DELAY_US: self.max_delay_us,
            TTFT_P95_MS: self.ttft_p95_ms,
            ITL_P95_MS: self.itl_p95_ms,
        }
        return {key: f"{value:g}" for key, value in values.items() if value is not None}

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ObjectiveQuery:
        """Parse a query; a value that is not a finite number is a ValueError naming it."""

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

        low, high = number(MIN_DELAY_US), number(MAX_DELAY_US)
        return cls(
            slo_p95_ms=number(SLO_P95_MS),
            margin_ms=number(MARGIN_MS),
            min_delay_us=round(low) if low is not None else None,
            max_delay_us=round(high) if high is not None else None,
            ttft_p95_ms=number(TTFT_P95_MS),
            itl_p95_ms=number(ITL_P95_MS),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SidecarInfo:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    version: str
    started_at: str | None
    triton_url: str
    metrics_url: str
    interval_seconds: float
    rate_window_seconds: float
    fit_window_seconds: float
    max_models: int
    models_tracked: int
    models_untracked: int
    models_evicted: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceReport:
    """How fresh one of the sidecar's readings is."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    last_success_at: str | None
    age_seconds: float | None
    stale: bool
    error: str | None
    successes: int
    failures: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sources:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    triton_metrics: SourceReport
    triton_statistics: SourceReport
    gpu: SourceReport


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceReport:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    utilization: float | None = None
    """Fraction (0 to 1) of NVML's last sample period during which a kernel ran."""
    memory_used_bytes: float | None = None
    """Without the memory the driver reserves, as nvidia-smi and DCGM count it."""
    memory_reserved_bytes: float | None = None
    memory_total_bytes: float | None = None
    memory_free_bytes: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_mhz: float | None = None
    temperature_celsius: float | None = None
    problems: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuReport:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    status: Literal["available", "unavailable"]
    source: str | None = None
    reason: str | None = None
    devices: tuple[DeviceReport, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveReport:
    """The objective the recommendations in this document were made for."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    slo_p95_ms: float
    margin_ms: float
    min_delay_us: int
    max_delay_us: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    """What Triton counted for a model over the rate window: the raw counts behind the rates."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    seconds: float
    requests_succeeded: float
    requests_failed: float
    inferences: float
    executions: float
    request_us: float
    queue_us: float
    compute_infer_us: float
    pending_requests: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatencyReport:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    source: LatencySource
    """summary: Triton's measured quantiles; estimated: a model of them (never fed to rules)."""
    method: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigReport:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    max_batch_size: int
    max_queue_delay_microseconds: int | None
    preferred_batch_sizes: tuple[int, ...]
    memory_per_item_bytes: float | None
    max_num_seqs: int | None = None
    """For a model served by vLLM, the most sequences its engine runs, when the sidecar knows
    it: a running count of the LLM step-time fit never exceeds it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitPoint:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    batch_size: int
    median_ms: float | None
    executions: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTimeReport:
    """The fit of t_step(b) = t0 + c * b^alpha; the fitted fields are null while insufficient."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    status: Literal["fitted", "insufficient"]
    reason: str | None = None
    batch_sizes: tuple[int, ...] = ()
    observations: int = 0
    up_to_date: bool = False
    t0_ms: float | None = None
    c_ms: float | None = None
    alpha: float | None = None
    r_squared: float | None = None
    rmse_ms: float | None = None
    span: float | None = None
    executions: int | None = None
    outliers: tuple[int, ...] = ()
    points: tuple[FitPoint, ...] = ()
    fitted_ago_seconds: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueueDelayReport:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    status: Literal["ok", "unavailable"]
    reason: str
    microseconds: int | None = None
    expected_batch_size: float | None = None
    step_ms: float | None = None
    margin_ms: float | None = None
    meets_objective: bool | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecommendationReport:
    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    status: Literal["ok", "unavailable"]
    reason: str | None = None
    """Why there is none (status unavailable)."""
    arrival_rate: float | None = None
    """Inferences (batch items) per second over the rate window."""
    preferred_batch_size: int | None = None
    preferred_batch_reason: str | None = None
    knee: float | None = None
    memory_cap_batch_size: int | None = None
    memory_cap_reason: str | None = None
    queue_delay: QueueDelayReport | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlmObjectiveReport:
    """The engine-side objectives an LLM recommendation was made for."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    ttft_p95_ms: float | None
    itl_p95_ms: float | None
    margin_fraction: float
    """Each objective's margin, as a fraction of it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLimitReport:
    """One recommended engine limit (vLLM max_num_seqs or max_num_batched_tokens)."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    status: Literal["ok", "unavailable"]
    reason: str
    value: int | None = None
    step_ms: float | None = None
    """The fitted step time the rule used."""
    margin_ms: float | None = None
    meets_objective: bool | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlmRecommendationReport:
    """maxNumSeqs for itlP95Ms and maxNumBatchedTokens for ttftP95Ms, from the fitted step time
    at the measured load; recommended, never applied."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    status: Literal["ok", "unavailable"]
    reason: str | None = None
    """Why there is none (status unavailable)."""
    objective: LlmObjectiveReport | None = None
    assumed_running_sequences: int | None = None
    """The sequences taken to run in every step (the engine full)."""
    mean_prompt_tokens: float | None = None
    """Prompt tokens per request over the rate window."""
    prompt_tokens_per_second: float | None = None
    max_num_seqs: EngineLimitReport | None = None
    max_num_batched_tokens: EngineLimitReport | None = None

    def recommended(self) -> tuple[int | None, int | None]:
        """(maxNumSeqs, maxNumBatchedTokens), each None where not recommended."""

        def value(limit: EngineLimitReport | None) -> int | None:
            return limit.value if limit is not None and limit.status == "ok" else None

        return value(self.max_num_seqs), value(self.max_num_batched_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlmReport:
    """What an LLM engine measured itself over the rate window (Triton's vLLM backend with
    REPORT_CUSTOM_METRICS): quantiles are null without observations."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    """Time to first token, from the request's arrival in the engine."""
    inter_token_p50_ms: float | None
    inter_token_p95_ms: float | None
    """Time between consecutive tokens of a request, in the engine."""
    first_tokens: float
    """Requests that got their first token in the window."""
    output_tokens_per_second: float
    prompt_tokens_per_second: float
    running_sequences: float
    waiting_sequences: float
    kv_cache_usage: float | None
    """Fraction of the KV cache in use (0..1), when exported."""
    step_time: StepTimeReport | None = None
    """The fit of the engine's step time (mean inter-token latency) against its running
    sequences over the fit window: `batchSizes` and the points' `batchSize` are running counts,
    `executions` the inter-token gaps behind them."""
    recommendation: LlmRecommendationReport | None = None

    @classmethod
    def from_rates(cls, rates: scraping.ModelRates | None) -> LlmReport | None:
        """What the engine counted over a window; None for a model without engine metrics."""
        if rates is None or rates.engine is None or rates.seconds <= 0:
            return None
        engine = rates.engine

        def milliseconds(histogram: engine_metrics.Histogram, q: float) -> float | None:
            seconds = histogram.quantile(q)
            return None if seconds is None else _rounded(seconds * 1000)

        return cls(
            ttft_p50_ms=milliseconds(engine.time_to_first_token, 0.5),
            ttft_p95_ms=milliseconds(engine.time_to_first_token, 0.95),
            inter_token_p50_ms=milliseconds(engine.inter_token, 0.5),
            inter_token_p95_ms=milliseconds(engine.inter_token, 0.95),
            first_tokens=engine.time_to_first_token.count,
            output_tokens_per_second=_rounded(engine.generation_tokens / rates.seconds) or 0.0,
            prompt_tokens_per_second=_rounded(engine.prompt_tokens / rates.seconds) or 0.0,
            running_sequences=engine.running,
            waiting_sequences=engine.waiting,
            kv_cache_usage=_rounded(engine.kv_cache_usage),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelReport:
    """One model: its window, rates, latency, served config, step-time fit and recommendation.
    The rates are null when no window has been measured yet."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    last_seen_ago_seconds: float | None
    last_active_ago_seconds: float | None
    window: Window | None
    request_rate: float | None = None
    success_rate: float | None = None
    failure_rate: float | None = None
    inference_rate: float | None = None
    execution_rate: float | None = None
    average_batch_size: float | None = None
    queue_ms_per_request: float | None = None
    compute_ms_per_request: float | None = None
    pending_requests: float | None = None
    compute_ms_per_execution: float | None = None
    latency_ms: LatencyReport
    config: ConfigReport | None
    config_error: str | None
    step_time: StepTimeReport
    recommendation: RecommendationReport
    llm: LlmReport | None = None
    """For a model served by an LLM engine that exports its metrics."""

    def rates(self) -> scraping.ModelRates | None:
        """The window as the rates Triton's own pages give, with measured quantiles only."""
        window = self.window
        if window is None or window.seconds <= 0:
            return None
        measured = self.latency_ms if self.latency_ms.source == "summary" else None
        return scraping.ModelRates(
            seconds=window.seconds,
            counted=scraping.ModelCounters(
                requests_succeeded=window.requests_succeeded,
                requests_failed=window.requests_failed,
                inferences=window.inferences,
                executions=window.executions,
                request_us=window.request_us,
                queue_us=window.queue_us,
                compute_infer_us=window.compute_infer_us,
            ),
            pending=window.pending_requests,
            p50_ms=measured.p50 if measured else None,
            p95_ms=measured.p95 if measured else None,
            p99_ms=measured.p99 if measured else None,
        )

    def recommended_delay_us(self) -> int | None:
        delay = self.recommendation.queue_delay
        return delay.microseconds if delay is not None and delay.status == "ok" else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatusDocument:
    """Everything a sidecar knows, as `/status` serves it."""

    __pydantic_config__: ClassVar[Mapping[str, Any]] = _WIRE

    sidecar: SidecarInfo
    fresh: bool
    """Triton's metrics and statistics were both read within the last few intervals."""
    sources: Sources
    gpu: GpuReport
    objective: ObjectiveReport | None
    models: Mapping[str, ModelReport]

    def rates(self) -> dict[str, scraping.ModelRates]:
        found = {name: model.rates() for name, model in self.models.items()}
        return {name: rates for name, rates in found.items() if rates is not None}

    def llm_reports(self) -> dict[str, LlmReport]:
        """The models served by an LLM engine that exports its metrics."""
        return {name: model.llm for name, model in self.models.items() if model.llm is not None}

    def recommended_delays(self, models: Collection[str]) -> list[int]:
        """The queue delays recommended for these models (all when empty)."""
        delays = (
            model.recommended_delay_us()
            for name, model in self.models.items()
            if not models or name in models
        )
        return [delay for delay in delays if delay is not None]

    def recommended_llm_limits(self, models: Collection[str]) -> tuple[list[int], list[int]]:
        """The maxNumSeqs and the maxNumBatchedTokens recommended for these LLM models (all
        when empty)."""
        seqs: list[int] = []
        tokens: list[int] = []
        for name, model in self.models.items():
            found = model.llm.recommendation if model.llm is not None else None
            if found is None or (models and name not in models):
                continue
            model_seqs, model_tokens = found.recommended()
            seqs.extend([model_seqs] if model_seqs is not None else [])
            tokens.extend([model_tokens] if model_tokens is not None else [])
        return seqs, tokens

    def gpu_utilization(self) -> list[float]:
        return [d.utilization for d in self.gpu.devices if d.utilization is not None]
