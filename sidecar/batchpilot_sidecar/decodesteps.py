"""How long one step of an LLM engine takes against how many sequences it runs: fitting
`t_step(b) = t0 + c * b**alpha` from the engine's own metrics.

An engine that batches continuously (vLLM) runs every sequence it holds in each step and gives
each one token, so the time between two tokens of a sequence is one step, and the step's batch is
the number of sequences that got a token in it. Neither is reported per step: the engine exports
histograms and counters, and its `running` gauge is set per step and read at any instant (here it
read 0 on busy seconds, and readings a step apart differ by whole requests). So a span of
collection intervals gives one sample:

- the mean step is the mean gap between tokens: the increase of the inter-token histogram's sum
  over the increase of its count;
- the mean number of sequences a step ran is the tokens generated over the steps taken: the
  increase of `vllm:generation_tokens_total` over that of the count of
  `vllm:iteration_tokens_total` (a histogram with one observation per engine step, which
  NVIDIA's vLLM backend exports).

Both are measured on the engine's clock and recorded together, step by step, so a sample is right
however late the statistics reach Triton's metrics: they arrive in bunches (the engine's front
end, which records them, starves for seconds on a busy CPU; here a 16-sequence burst's 5 s of
statistics landed in one 0.7-s bunch). An engine that does not count its steps falls back on
Little's law: the gaps' total time over the span's length is the time-averaged number of
sequences running in it, which holds only if the gaps recorded in the span are the gaps that lay
in it. For that fallback a sample pools consecutive intervals (`Pool`) until they span
`SAMPLE_SECONDS`, over which the bunches mostly even out, and where the engine's limit is known
(vLLM's `max_num_seqs`) a sample's running count is clamped to it: what overshoots it is late
statistics, not sequences.

The samples of the fit window are fitted by the classic step-time fit (`steptimes.fit`: per
running count, rounded, a weighted median, then a robust power-law fit), each weighted by the
tokens behind it.

What a sample's step is: the mean gap between tokens at that load, steps that also carried prompt
chunks (chunked prefill) included, so the curve describes the engine under the mix of prompts
and decodes it served, not a pure decode step. A sample whose steps ran different batches (a
load that changed within the span) gives their token-weighted mean step against their mean
batch; the robust fit discounts samples that disagree with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchpilot_sidecar import steptimes
from batchpilot_triton import engine_metrics

MIN_RUNNING_COUNTS = steptimes.MIN_BATCH_SIZES
"""Distinct running-sequence counts a fit needs; alpha trades off against t0 and c as with
batch sizes."""
MIN_SPAN = steptimes.MIN_SPAN
MIN_TOKENS = 16
"""Inter-token gaps measured at one running count before it counts as seen."""
NAMED = "running-sequence counts"
SAMPLE_SECONDS = 2.0
"""The shortest span of consecutive collection intervals a sample covers. Without step counts
the engine's statistics, which reach Triton in bunches, read over a short interval as more
sequences than the engine holds; over a few seconds the bunches mostly even out. The default
10-minute fit window still holds 300 samples."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One span of collection intervals of an LLM engine."""

    running: float
    """The sequences a step of the span ran on average (tokens generated per step), or, for an
    engine that does not count its steps, the mean running over the span."""
    tokens: int
    """Inter-token gaps the engine measured in the span."""
    mean_ms: float
    """Their mean: the mean step time at that load."""

    def as_observation(self) -> steptimes.Observation:
        # A token was produced, so at least one sequence ran, however short the busy part was.
        return steptimes.Observation(
            batch_size=max(1, round(self.running)), executions=self.tokens, mean_ms=self.mean_ms
        )


def sample(
    engine: engine_metrics.EngineCounts, *, seconds: float, max_running: int | None = None
) -> Sample | None:
    """The sample of a span of `seconds`, its running count at most `max_running` (the engine's
    limit, when known); None when the engine measured no inter-token gap in it."""
    inter_token = engine.inter_token
    tokens = round(inter_token.count)
    if tokens <= 0 or inter_token.total < 0 or seconds <= 0:
        return None
    steps = engine.iteration_tokens.count
    running = engine.generation_tokens / steps if steps > 0 else inter_token.total / seconds
    return Sample(
        running=running if max_running is None else min(running, max_running),
        tokens=tokens,
        mean_ms=1000.0 * inter_token.total / inter_token.count,
    )


class Pool:
    """Consecutive collection intervals of one engine, summed until they span
    `SAMPLE_SECONDS`."""

    def __init__(self) -> None:
        self.engine = engine_metrics.EngineCounts()
        self.seconds = 0.0

    def add(
        self,
        engine: engine_metrics.EngineCounts,
        *,
        seconds: float,
        max_running: int | None = None,
    ) -> Sample | None:
        """Add an interval of `seconds`, idle or not. Once the pool spans `SAMPLE_SECONDS`, its
        sample (None if the engine measured no gap in it) and the pool starts over; until then
        None."""
        self.engine += engine
        self.seconds += seconds
        if self.seconds < SAMPLE_SECONDS:
            return None
        found = sample(self.engine, seconds=self.seconds, max_running=max_running)
        self.engine, self.seconds = engine_metrics.EngineCounts(), 0.0
        return found


def fit(samples: Iterable[Sample]) -> steptimes.Fit | steptimes.NotEnoughData:
    """The step time against the running sequences, or what is missing."""
    return steptimes.fit(
        (s.as_observation() for s in samples),
        min_batch_sizes=MIN_RUNNING_COUNTS,
        min_span=MIN_SPAN,
        min_executions=MIN_TOKENS,
        named=NAMED,
    )
