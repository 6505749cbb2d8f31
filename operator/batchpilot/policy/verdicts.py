"""Judging a canary: do the replicas that took new settings serve as well as the rest?

A canary's replicas and the others (the baseline) serve the same model over the same window, so
the comparison is of ratios and differences, never of absolute figures, which the load and the
machine decide. Each reading of the fleet gives one `Sample`: what each group served since the
previous reading. The verdict comes at the end of the analysis window, from all of them:

- **failures** are counts: the canary's failure rate over the window, less the baseline's, may
  not pass `max_failure_rate`. Once the canary has served `min_requests` and already failed
  beyond the limit, the verdict comes at once: every further request on bad settings is a cost.
- **latency** quantiles are noisy (one slow second, one GC pause), so each reading gives a ratio
  of canary to baseline, and the window is judged by the median ratio: one slow reading, or
  fewer than half of them, cannot fail a canary, and no single fast one can pass it.
- **too little to judge** (the canary or the baseline served fewer than `min_requests`, or no
  reading had a quantile on both sides) is inconclusive, and says which.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["Promote", "Rollback", "Inconclusive"]

LATENCY_READINGS_AT_LEAST = 3
"""Readings with a quantile on both sides that a latency ratio needs: a median of one or two
is a single moment again."""


@dataclass(frozen=True)
class Served:
    """What one group of replicas served of the governed models between two readings."""

    requests: float = 0.0
    failures: float = 0.0
    p95_ms: float | None = None
    p99_ms: float | None = None
    ttft_p95_ms: float | None = None
    inter_token_p95_ms: float | None = None


@dataclass(frozen=True)
class Sample:
    at: datetime.datetime
    canary: Served
    baseline: Served


@dataclass(frozen=True)
class Limits:
    """What a canary is judged by (spec.rollout.canary)."""

    analysis: datetime.timedelta
    min_requests: int
    max_failure_rate: float
    """How much higher the canary's failure rate may be than the baseline's (0.01: one point)."""
    max_p95_ratio: float
    max_p99_ratio: float | None = None
    max_ttft_p95_ratio: float | None = None
    max_inter_token_p95_ratio: float | None = None


QUANTILES: tuple[tuple[str, str], ...] = (
    ("p95_ms", "max_p95_ratio"),
    ("p99_ms", "max_p99_ratio"),
    ("ttft_p95_ms", "max_ttft_p95_ratio"),
    ("inter_token_p95_ms", "max_inter_token_p95_ratio"),
)
"""Each judged quantile of `Served`, with the limit on its ratio in `Limits`."""

LABELS = {
    "p95_ms": "p95",
    "p99_ms": "p99",
    "ttft_p95_ms": "TTFT p95",
    "inter_token_p95_ms": "inter-token p95",
}


@dataclass(frozen=True)
class Figures:
    """The window so far: totals and the median ratio of each quantile judged."""

    canary_requests: float
    canary_failure_rate: float | None
    baseline_requests: float
    baseline_failure_rate: float | None
    ratios: dict[str, float]
    """Median canary/baseline ratio by quantile (`p95_ms`, ...), where it could be measured."""

    def describe(self) -> str:
        def rate(value: float | None) -> str:
            return "-" if value is None else f"{100 * value:.2f}%"

        parts = [
            f"canary {self.canary_requests:.0f} requests, {rate(self.canary_failure_rate)} failed",
            f"baseline {self.baseline_requests:.0f}, {rate(self.baseline_failure_rate)} failed",
        ]
        parts += [f"{LABELS[name]} {ratio:.2f}x" for name, ratio in self.ratios.items()]
        return "; ".join(parts)


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict | None
    """None while the window is still open and nothing has failed yet."""
    reason: str
    figures: Figures


def figures(samples: Sequence[Sample], limits: Limits) -> Figures:
    canary_requests = sum(sample.canary.requests for sample in samples)
    canary_failures = sum(sample.canary.failures for sample in samples)
    baseline_requests = sum(sample.baseline.requests for sample in samples)
    baseline_failures = sum(sample.baseline.failures for sample in samples)
    ratios = {}
    for name, limit in QUANTILES:
        if getattr(limits, limit) is None:
            continue
        seen = [
            canary / baseline
            for sample in samples
            if (canary := getattr(sample.canary, name)) is not None
            and (baseline := getattr(sample.baseline, name)) is not None
            and baseline > 0
        ]
        if len(seen) >= LATENCY_READINGS_AT_LEAST:
            ratios[name] = statistics.median(seen)
    return Figures(
        canary_requests=canary_requests,
        canary_failure_rate=canary_failures / canary_requests if canary_requests else None,
        baseline_requests=baseline_requests,
        baseline_failure_rate=baseline_failures / baseline_requests if baseline_requests else None,
        ratios=ratios,
    )


def judge(
    samples: Sequence[Sample], limits: Limits, started: datetime.datetime, now: datetime.datetime
) -> Judgement:
    """The verdict on a canary analysed since `started`, from the readings taken since."""
    found = figures(samples, limits)
    failing = _failing(found, limits)
    if failing is not None and found.canary_requests >= limits.min_requests:
        return Judgement("Rollback", failing, found)
    if now - started < limits.analysis:
        return Judgement(None, "analysing", found)
    if failing is not None:
        return Judgement("Rollback", failing, found)
    short = [
        f"the {side} served {served:.0f} requests of the {limits.min_requests} needed"
        for side, served in (
            ("canary", found.canary_requests),
            ("baseline", found.baseline_requests),
        )
        if served < limits.min_requests
    ]
    if short:
        return Judgement("Inconclusive", "; ".join(short), found)
    if "p95_ms" not in found.ratios:
        return Judgement(
            "Inconclusive",
            f"fewer than {LATENCY_READINGS_AT_LEAST} readings had a p95 on both sides",
            found,
        )
    slow = _too_slow(found, limits)
    if slow:
        return Judgement("Rollback", slow, found)
    return Judgement("Promote", "within every limit", found)


def _failing(found: Figures, limits: Limits) -> str | None:
    if found.canary_failure_rate is None:
        return None
    excess = found.canary_failure_rate - (found.baseline_failure_rate or 0.0)
    if excess <= limits.max_failure_rate:
        return None
    return (
        f"failure rate {100 * found.canary_failure_rate:.2f}% against the baseline's "
        f"{100 * (found.baseline_failure_rate or 0.0):.2f}%: more than "
        f"{100 * limits.max_failure_rate:g} points above it"
    )


def _too_slow(found: Figures, limits: Limits) -> str:
    breaches = []
    for name, limit_name in QUANTILES:
        limit = getattr(limits, limit_name)
        ratio = found.ratios.get(name)
        if limit is not None and ratio is not None and ratio > limit:
            breaches.append(f"{LABELS[name]} {ratio:.2f}x the baseline's (limit {limit:g}x)")
    return "; ".join(breaches)
