"""An LLM engine's batching limits that follow from its step time and latency objectives.

An engine that batches continuously has no queue delay to tune; what trades latency for
throughput is how many sequences it runs at once (vLLM `max_num_seqs`) and how many tokens one
step may carry (`max_num_batched_tokens`). Both rules take the fitted step time against the
running sequences (`decodesteps`), and each keeps a margin of `MARGIN_FRACTION` of its objective
for what the fitted mean does not see (the spread of step times, steps slowed by prompt chunks).

- **maxNumSeqs, for the inter-token objective.** With b sequences running, each gets one token
  per step, so the time between its tokens is `t_step(b)`. The recommendation is the largest b
  with `t_step(b) + margin <= itlP95Ms`. The fit knows nothing beyond the running counts it
  measured, so b is capped at `EXTRAPOLATION_LIMIT` times the largest one; once the engine runs
  that many the recommendation can climb further.
- **maxNumBatchedTokens, for the time-to-first-token objective.** With chunked prefill a step
  carries one token of each running sequence and fills the rest of its budget B with prompt
  chunks, so a prompt of P tokens takes `ceil(P / (B - n))` steps before its first token, each
  lasting about `t_step(n)`. Within the objective that allows `k = floor((ttftP95Ms - margin) /
  t_step(n))` steps, so `B = n + ceil(P / k)`: the smallest budget that prefills a prompt in
  time, since larger chunks lengthen the steps every running sequence waits on. The budget must
  also keep up with the prompts that arrive: at least `PREFILL_HEADROOM` times the prompt
  tokens arriving during one step, or prompts queue without bound. B is at least n, as the
  engine (and the CRD) require.

The load assumed: the engine runs full (n = the recommended maxNumSeqs, or without an
inter-token objective the most sequences measured running) while prompts of the measured mean
length arrive at the measured rate. A prompt that waits for a free sequence slot is not covered
(that wait shrinks only with more sequences or less load), nor is a prompt longer than the mean.
Without chunked prefill vLLM needs the budget to hold a whole prompt (at least max_model_len);
the rule assumes chunked prefill. Nothing here is applied: the operator shows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot_sidecar import steptimes
from batchpilot_triton import repositories

MARGIN_FRACTION = 0.1
"""Each objective's margin, as a fraction of it."""
EXTRAPOLATION_LIMIT = 2.0
"""How far beyond the most running sequences measured maxNumSeqs may go."""
PREFILL_HEADROOM = 2.0
"""How many times the arriving prompt tokens a step's prefill budget must carry."""
MAX_NUM_SEQS = repositories.MAX_NUM_SEQS
MAX_NUM_BATCHED_TOKENS = repositories.MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True, kw_only=True)
class LlmObjective:
    """The engine-side latency objectives of a policy (`spec.slo`), in milliseconds."""

    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("ttftP95Ms", self.ttft_p95_ms), ("itlP95Ms", self.itl_p95_ms)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of ms, not {value:g}")

    @property
    def given(self) -> bool:
        return self.ttft_p95_ms is not None or self.itl_p95_ms is not None


@dataclass(frozen=True, kw_only=True)
class Limit:
    """One recommended engine limit and how it was reached."""

    value: int
    step_ms: float
    """The fitted step time the rule used."""
    margin_ms: float
    meets_objective: bool
    """False when even the smallest (or largest) limit cannot meet the objective."""
    reason: str


def max_num_seqs(
    step: steptimes.StepTimeModel, *, itl_p95_ms: float, most_running_seen: int
) -> Limit:
    margin = MARGIN_FRACTION * itl_p95_ms
    budget = itl_p95_ms - margin
    cap = min(MAX_NUM_SEQS, max(1, math.floor(EXTRAPOLATION_LIMIT * most_running_seen)))
    if step.ms(1) > budget:
        return Limit(
            value=1,
            step_ms=step.ms(1),
            margin_ms=margin,
            meets_objective=False,
            reason=f"a step of one sequence takes {step.ms(1):.2f} ms, more than itlP95Ms "
            f"{itl_p95_ms:g} ms - margin {margin:.3g} ms: the objective cannot be met",
        )
    if step.c_ms > 0:
        fits = ((budget - step.t0_ms) / step.c_ms) ** (1.0 / step.alpha)
        largest = math.floor(fits + 1e-9)
        while largest > 1 and step.ms(largest) > budget:  # rounding at the boundary
            largest -= 1
    else:
        largest = cap
    value = max(1, min(largest, cap))
    bound = (
        f"capped at {EXTRAPOLATION_LIMIT:g}x the most running sequences measured "
        f"({most_running_seen})"
        if largest > cap
        else "the largest that fits"
    )
    return Limit(
        value=value,
        step_ms=step.ms(value),
        margin_ms=margin,
        meets_objective=True,
        reason=f"itlP95Ms {itl_p95_ms:g} ms - margin {margin:.3g} ms leaves {budget:.2f} ms a "
        f"step; {value} sequences take {step.ms(value):.2f} ms: {bound}",
    )


def max_num_batched_tokens(
    step: steptimes.StepTimeModel,
    *,
    ttft_p95_ms: float,
    running: int,
    prompt_tokens: float,
    prompt_tokens_per_second: float,
) -> Limit:
    """The step budget for prompts of `prompt_tokens` (mean) arriving at the measured rate with
    `running` sequences decoding in every step."""
    margin = MARGIN_FRACTION * ttft_p95_ms
    step_ms = step.ms(running)
    steps = math.floor((ttft_p95_ms - margin) / step_ms)
    keep_up = math.ceil(PREFILL_HEADROOM * prompt_tokens_per_second * step_ms / 1000.0)
    prompt = math.ceil(prompt_tokens)
    if steps < 1:
        value = min(running + max(prompt, keep_up), MAX_NUM_BATCHED_TOKENS)
        return Limit(
            value=value,
            step_ms=step_ms,
            margin_ms=margin,
            meets_objective=False,
            reason=f"a step with {running} sequences takes {step_ms:.2f} ms, more than "
            f"ttftP95Ms {ttft_p95_ms:g} ms - margin {margin:.3g} ms: the objective cannot be "
            f"met; {value} tokens prefill a {prompt_tokens:.0f}-token prompt in one step",
        )
    chunk = math.ceil(prompt_tokens / steps)
    value = min(running + max(chunk, keep_up, 1), MAX_NUM_BATCHED_TOKENS)
    bound = (
        f"prefill {chunk} tokens a step, a {prompt_tokens:.0f}-token prompt in {steps} steps"
        if chunk >= keep_up
        else f"{keep_up} prompt tokens a step keep up with {prompt_tokens_per_second:.4g} "
        f"arriving a second ({PREFILL_HEADROOM:g}x)"
    )
    return Limit(
        value=value,
        step_ms=step_ms,
        margin_ms=margin,
        meets_objective=True,
        reason=f"ttftP95Ms {ttft_p95_ms:g} ms - margin {margin:.3g} ms allows {steps} steps of "
        f"{step_ms:.2f} ms with {running} sequences running; {running} decode tokens + {bound}",
    )
