"""An LLM engine's own metrics on Triton's metrics page, and what they say over a window.

Triton's vLLM backend (with the config parameter `REPORT_CUSTOM_METRICS`) exports vLLM's
statistics beside Triton's, measured inside the engine: time to first token, the time between
tokens and the tokens of each engine step as histograms, tokens generated as counters, running
and waiting requests and KV-cache use as gauges. Over a window the histograms' increases give TTFT
and inter-token quantiles the way PromQL's `histogram_quantile(rate(...))` does, series by series,
so a reload's fresh series count from zero like any other counter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TTFT_SECONDS = "vllm:time_to_first_token_seconds"
ITL_SECONDS = "vllm:inter_token_latency_seconds"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
"""Tokens per engine step, a histogram (despite its name): its count is the engine's steps."""
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"

HISTOGRAMS = (TTFT_SECONDS, ITL_SECONDS, ITERATION_TOKENS)
COUNTERS = (GENERATION_TOKENS, PROMPT_TOKENS)
GAUGES = (RUNNING, WAITING, KV_CACHE_USAGE)


@dataclass(frozen=True)
class Histogram:
    """A histogram's increase over a window: cumulative counts by upper bound, and the count."""

    buckets: Mapping[float, float] = field(default_factory=dict)
    count: float = 0.0
    total: float = 0.0

    def __add__(self, other: Histogram) -> Histogram:
        bounds = set(self.buckets) | set(other.buckets)
        return Histogram(
            {b: self.buckets.get(b, 0.0) + other.buckets.get(b, 0.0) for b in bounds},
            self.count + other.count,
            self.total + other.total,
        )

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated linearly inside its bucket as Prometheus does; None
        without observations. One beyond the highest finite bound is that bound."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in sorted(self.buckets.items()):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                inside = cumulative - lower_count
                share = (rank - lower_count) / inside if inside > 0 else 1.0
                return lower_bound + (bound - lower_bound) * share
            lower_bound, lower_count = bound, cumulative
        return lower_bound


@dataclass(frozen=True)
class EngineCounts:
    """What one model's engine counted over a window, and its gauges at the end of it."""

    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
    iteration_tokens: Histogram = field(default_factory=Histogram)
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None

    def __add__(self, later: EngineCounts) -> EngineCounts:
        """Consecutive windows as one: counts add up, gauges are the later window's."""
        return EngineCounts(
            self.time_to_first_token + later.time_to_first_token,
            self.inter_token + later.inter_token,
            self.iteration_tokens + later.iteration_tokens,
            self.generation_tokens + later.generation_tokens,
            self.prompt_tokens + later.prompt_tokens,
            later.running,
            later.waiting,
            later.kv_cache_usage,
        )


def is_counted(family: str) -> bool:
    """Whether a family (as the Prometheus parser names it: counters without `_total`) is one
    of the engine's counters or histograms, whose samples count up."""
    return family in HISTOGRAMS or f"{family}_total" in COUNTERS


SeriesKey = tuple[str, frozenset[tuple[str, str]]]


def engine_counts(
    increases: Mapping[SeriesKey, float], gauges: Mapping[SeriesKey, float]
) -> dict[str, EngineCounts]:
    """Per model, from the series' increases (counters and histogram samples, keyed by sample
    name) and the gauges at the end of the window."""
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str, str], float] = {}
    for (sample, labels), value in increases.items():
        named = dict(labels)
        model = named.get("model")
        if model is None:
            continue
        for family in HISTOGRAMS:
            if sample == f"{family}_bucket" and "le" in named:
                per_bound = buckets.setdefault((model, family), {})
                bound = float(named["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + value
            elif sample in (f"{family}_count", f"{family}_sum"):
                key = (model, family, sample.rsplit("_", 1)[1])
                sums[key] = sums.get(key, 0.0) + value
        if sample in COUNTERS:
            sums[(model, sample, "")] = sums.get((model, sample, ""), 0.0) + value
    latest: dict[tuple[str, str], float] = {}
    for (family, labels), value in gauges.items():
        model = dict(labels).get("model")
        if family in GAUGES and model is not None:
            latest[(model, family)] = latest.get((model, family), 0.0) + value
    models = {model for model, _ in buckets} | {model for model, *_ in sums}
    models |= {model for model, _ in latest}

    def histogram(model: str, family: str) -> Histogram:
        return Histogram(
            buckets.get((model, family), {}),
            sums.get((model, family, "count"), 0.0),
            sums.get((model, family, "sum"), 0.0),
        )

    return {
        model: EngineCounts(
            time_to_first_token=histogram(model, TTFT_SECONDS),
            inter_token=histogram(model, ITL_SECONDS),
            iteration_tokens=histogram(model, ITERATION_TOKENS),
            generation_tokens=sums.get((model, GENERATION_TOKENS, ""), 0.0),
            prompt_tokens=sums.get((model, PROMPT_TOKENS, ""), 0.0),
            running=latest.get((model, RUNNING), 0.0),
            waiting=latest.get((model, WAITING), 0.0),
            kv_cache_usage=latest.get((model, KV_CACHE_USAGE)),
        )
        for model in models
    }


def summed(windows: Iterable[EngineCounts | None]) -> EngineCounts | None:
    total: EngineCounts | None = None
    for window in windows:
        if window is not None:
            total = window if total is None else total + window
    return total
