"""Judging a canary: do the replicas that took new settings serve as they should?

A change is judged against what it is for:

- **an edit** (a profile's settings changed while it is in force, a delay autotune recommends)
  should not change latency: the canary is compared with the replicas still serving the old
  settings of the same profile (the baseline), by ratios, never by absolute figures, which the
  load and the machine decide;
- **a switch into another profile** (interactive to bulk) exists to change latency: comparing
  bulk with replicas still on interactive would fail every bulk. Its latency is judged against
  that profile's own objectives (`Objectives`: the SLO's p95, TTFT and inter-token objectives
  where the SLO governs the profile), and not at all where it has none.

Whatever the change, no profile is meant to fail more than the rest of the fleet, so failures
are always judged against the baseline. Each reading of the fleet gives one `Sample`: what each
group served since the previous reading. The verdict comes at the end of the analysis window:

- **failures** are counts: the canary's failure rate over the window, less the baseline's, may
  not pass `max_failure_rate`. Once the canary has served `min_requests` and already failed
  beyond the limit, the verdict comes at once: every further request on bad settings is a cost.
- **refusals nobody counts**: Triton 2.51 counts a request that timed out in its queue
  (`nv_inference_request_failure{reason="REJECTED"}`) but not one refused because the queue was
  full (`maxQueueSize`): the client gets a 503 and no metric or statistic of Triton's moves. Every
  replica of a fleet gets its share of the arrivals, so a canary that counted far fewer requests
  per replica than the baseline did (less than `1 - SHARE_TOLERANCE` of it, and short by more
  than chance spreads counts at random: `SHARE_NOISE_SIGMAS` square roots of its share) lost the
  rest before Triton counted them, and they count as failed. A request still waiting in a queue
  is not lost: Triton counts it when it ends, so what each side holds
  (`nv_inference_pending_request_count`)
  counts with what it served: for the canary, the most its queue held at any settled reading,
  because a long delay releases its requests in batches, and a count pro-rated from a rolling
  window can fall a whole batch behind the arrivals (or be read while one executes, neither
  pending nor counted). A canary whose long delay holds its share in the queue is judged by its
  latency, not reported as refusing it.
- **latency** quantiles are noisy (one slow second, one GC pause), so each reading gives a ratio
  of canary to its reference, and the window is judged by the median ratio: one slow reading,
  or fewer than half of them, cannot fail a canary, and no single fast one can pass it.
- **too little to judge** (the canary or the baseline served fewer than `min_requests`, or no
  reading had a quantile on both sides) is inconclusive, and says which.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["Promote", "Rollback", "Inconclusive"]

LATENCY_READINGS_AT_LEAST = 3
"""Readings with a quantile on both sides that a latency ratio needs: a median of one or two
is a single moment again."""

SHARE_TOLERANCE = 0.25
"""How far below its share of the arrivals (the baseline's requests per replica) a canary's
count may fall before the rest counts as refused: balancing spreads arrivals unevenly over a
window (a Service picks at random; long-lived connections stick), but not by a quarter."""
SHARE_NOISE_SIGMAS = 3.0
"""...nor, at small counts, by more than chance: a replica's count of arrivals spread at random
varies by about the square root of its share, so a shortfall within this many of those refuses
nothing (a quarter of 36 is 1.5 of them, and a good change was rolled back for 9 "refused" of
a share of 36 on a busy machine)."""


@dataclass(frozen=True)
class Served:
    """What one group of replicas served of the governed models between two readings."""

    requests: float = 0.0
    failures: float = 0.0
    replicas: int | None = None
    """How many replicas these figures are of; None when unknown (then no share is judged)."""
    pending: float = 0.0
    """Requests waiting in these replicas' queues at the reading: arrived, not yet counted."""
    p95_ms: float | None = None
    p99_ms: float | None = None
    ttft_p95_ms: float | None = None
    inter_token_p95_ms: float | None = None


@dataclass(frozen=True)
class Sample:
    at: datetime.datetime
    canary: Served
    baseline: Served
    settled: bool = True
    """The source's rate window of this reading began after the canary took the settings: a
    reading that reaches back into the reload (requests stalled, counters restarted) says
    nothing of the canary's share of the arrivals."""


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


@dataclass(frozen=True)
class Objectives:
    """What a switch into a profile is judged by: that profile's own latency objectives (ms),
    each None where the profile has none."""

    p95_ms: float | None = None
    ttft_p95_ms: float | None = None
    inter_token_p95_ms: float | None = None

    def of(self, quantile: str) -> float | None:
        """The objective for a quantile of `Served` (`p95_ms`, ...); p99 has none."""
        return getattr(self, quantile, None) if quantile != "p99_ms" else None

    def describe(self) -> str:
        given = [
            f"{LABELS[name]} {value:g} ms"
            for name in ("p95_ms", "ttft_p95_ms", "inter_token_p95_ms")
            if (value := getattr(self, name)) is not None
        ]
        return ", ".join(given) or "none"


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
    """Median ratio of the canary's quantile to its reference (the baseline's for an edit, the
    objective for a switch), by quantile (`p95_ms`, ...), where it could be measured."""
    canary_refused: float = 0.0
    """Requests the canary's share of the arrivals says it lost before Triton counted them;
    already in `canary_requests` and `canary_failure_rate`."""
    against: str = "baseline"
    """What the ratios are of: `baseline` (an edit) or `objective` (a switch)."""

    def describe(self) -> str:
        def rate(value: float | None) -> str:
            return "-" if value is None else f"{100 * value:.2f}%"

        failed = rate(self.canary_failure_rate)
        canary = f"canary {self.canary_requests:.0f} requests, {failed} failed"
        if self.canary_refused:
            canary += f" ({self.canary_refused:.0f} refused uncounted)"
        parts = [
            canary,
            f"baseline {self.baseline_requests:.0f}, {rate(self.baseline_failure_rate)} failed",
        ]
        of = "" if self.against == "baseline" else f" of the {self.against}"
        parts += [f"{LABELS[name]} {ratio:.2f}x{of}" for name, ratio in self.ratios.items()]
        return "; ".join(parts)


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict | None
    """None while the window is still open and nothing has failed yet."""
    reason: str
    figures: Figures


def figures(
    samples: Sequence[Sample], limits: Limits, objectives: Objectives | None = None
) -> Figures:
    """The window's figures; `objectives` for a switch into another profile (its latency is
    then judged against them), None for an edit (against the baseline)."""
    refused = _refused(samples)
    canary_requests = sum(sample.canary.requests for sample in samples) + refused
    canary_failures = sum(sample.canary.failures for sample in samples) + refused
    baseline_requests = sum(sample.baseline.requests for sample in samples)
    baseline_failures = sum(sample.baseline.failures for sample in samples)
    ratios = {}
    for name, limit in QUANTILES:
        if getattr(limits, limit) is None:
            continue
        if objectives is None:
            seen = [
                canary / baseline
                for sample in samples
                if (canary := getattr(sample.canary, name)) is not None
                and (baseline := getattr(sample.baseline, name)) is not None
                and baseline > 0
            ]
        elif (objective := objectives.of(name)) is not None:
            seen = [
                canary / objective
                for sample in samples
                if (canary := getattr(sample.canary, name)) is not None
            ]
        else:
            continue  # nothing says how fast this profile should be: no latency judged
        if len(seen) >= LATENCY_READINGS_AT_LEAST:
            ratios[name] = statistics.median(seen)
    return Figures(
        canary_requests=canary_requests,
        canary_failure_rate=canary_failures / canary_requests if canary_requests else None,
        baseline_requests=baseline_requests,
        baseline_failure_rate=baseline_failures / baseline_requests if baseline_requests else None,
        ratios=ratios,
        canary_refused=refused,
        against="baseline" if objectives is None else "objective",
    )


def _refused(samples: Sequence[Sample]) -> float:
    """The requests the canary did not count of its share of the arrivals (see the module's
    docstring), over the window; 0 while its count is within SHARE_TOLERANCE of its share."""
    counted = share = 0.0
    held = held_share = 0.0
    for sample in samples:
        canary, baseline = sample.canary, sample.baseline
        if not sample.settled or not canary.replicas or not baseline.replicas:
            continue  # the reload's readings, or no replica count: no share to judge by
        counted += canary.requests
        share += baseline.requests / baseline.replicas * canary.replicas
        # What a queue holds is counted when it ends: arrived, not refused (the module's
        # docstring says why the canary's is the most it held).
        held = max(held, canary.pending)
        held_share = baseline.pending / baseline.replicas * canary.replicas
    counted += held
    share += held_share
    shortfall = share - counted
    if shortfall <= max(SHARE_TOLERANCE * share, SHARE_NOISE_SIGMAS * math.sqrt(share)):
        return 0.0
    return shortfall


def judge(
    samples: Sequence[Sample],
    limits: Limits,
    started: datetime.datetime,
    now: datetime.datetime,
    objectives: Objectives | None = None,
) -> Judgement:
    """The verdict on a canary analysed since `started`, from the readings taken since;
    `objectives` for a switch into another profile, None for an edit of the one in force."""
    found = figures(samples, limits, objectives)
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
    if objectives is None and "p95_ms" not in found.ratios:
        return Judgement(
            "Inconclusive",
            f"fewer than {LATENCY_READINGS_AT_LEAST} readings had a p95 on both sides",
            found,
        )
    unmeasured = [
        LABELS[name]
        for name, limit in QUANTILES
        if objectives is not None
        and getattr(limits, limit) is not None
        and objectives.of(name) is not None
        and name not in found.ratios
    ]
    if unmeasured:
        return Judgement(
            "Inconclusive",
            f"fewer than {LATENCY_READINGS_AT_LEAST} readings had a {', '.join(unmeasured)} "
            "to judge against the profile's objective",
            found,
        )
    slow = _too_slow(found, limits)
    if slow:
        return Judgement("Rollback", slow, found)
    if objectives is not None and not found.ratios:
        return Judgement(
            "Promote",
            "no more failures than the baseline; latency not judged: the profile has no "
            "objective, and a switch is not compared with replicas serving another profile",
            found,
        )
    return Judgement("Promote", "within every limit", found)


def _failing(found: Figures, limits: Limits) -> str | None:
    if found.canary_failure_rate is None:
        return None
    excess = found.canary_failure_rate - (found.baseline_failure_rate or 0.0)
    if excess <= limits.max_failure_rate:
        return None
    refused = (
        f", {found.canary_refused:.0f} of them refused before Triton counted them (the canary "
        "counted less than its share of the arrivals)"
        if found.canary_refused
        else ""
    )
    return (
        f"failure rate {100 * found.canary_failure_rate:.2f}%{refused} against the baseline's "
        f"{100 * (found.baseline_failure_rate or 0.0):.2f}%: more than "
        f"{100 * limits.max_failure_rate:g} points above it"
    )


def _too_slow(found: Figures, limits: Limits) -> str:
    breaches = []
    for name, limit_name in QUANTILES:
        limit = getattr(limits, limit_name)
        ratio = found.ratios.get(name)
        if limit is not None and ratio is not None and ratio > limit:
            reference = "the baseline's" if found.against == "baseline" else "its objective"
            breaches.append(f"{LABELS[name]} {ratio:.2f}x {reference} (limit {limit:g}x)")
    return "; ".join(breaches)
