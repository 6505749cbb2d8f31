"""Batching settings that follow from a model's step time, its load and a latency objective.

- **Queue delay.** A request that opens a batch waits the whole queue delay and then the step, so
  the p95 latency is about `delay + t_step(b) + margin`, where the margin covers what neither
  term sees (HTTP and serialisation, scheduling, step-time jitter). The recommendation is the
  longest delay that keeps that within the objective: `delay = clamp(SLO - t_step(b) - margin)`.
  The batch `b` itself grows with the delay — at an arrival rate of λ items per second a batch
  collects what arrives while it waits and while the previous one runs, the fixed point of
  `b = clamp(λ * (delay + t_step(b)), 1, maxBatch)` — and since `delay + t_step(b(delay))` only
  grows with the delay, the delay that exactly spends the budget is found by bisection.
- **Preferred batch size.** The knee of the step-time curve, where the part that grows with the
  batch costs as much as the fixed part (`(t0/c)**(1/alpha)`): below it, larger batches are
  nearly free throughput; above it, they mostly add latency. Rounded to a power of two (the sizes
  kernels are tuned for) and capped by the model's `max_batch_size` and by free GPU memory.
- **Memory cap.** Where a model declares how much device memory one more batch item takes, the
  batch that fits in the free memory of the fullest GPU, with headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot_sidecar import steptimes

DEFAULT_MARGIN_FRACTION = 0.1
"""The margin, when the caller gives none, as a fraction of the objective."""
MIN_DEFAULT_MARGIN_MS = 1.0
MEMORY_HEADROOM = 0.9
"""The fraction of free GPU memory a batch may use."""
_FIXED_POINT_ITERATIONS = 200
_BISECTION_ITERATIONS = 50


@dataclass(frozen=True, kw_only=True)
class Objective:
    """A caller's latency objective and the bounds its policy puts on the queue delay."""

    p95_ms: float
    margin_ms: float | None = None
    """None: `DEFAULT_MARGIN_FRACTION` of the objective, at least `MIN_DEFAULT_MARGIN_MS`."""
    min_delay_us: int = 0
    max_delay_us: int = 100_000

    def __post_init__(self) -> None:
        if not self.p95_ms > 0:
            raise ValueError(f"the p95 objective must be positive, not {self.p95_ms:g} ms")
        if self.margin_ms is not None and self.margin_ms < 0:
            raise ValueError(f"the margin must not be negative, not {self.margin_ms:g} ms")
        if not 0 <= self.min_delay_us <= self.max_delay_us:
            raise ValueError(
                f"delay bounds must satisfy 0 <= min <= max, not [{self.min_delay_us}, "
                f"{self.max_delay_us}] us"
            )

    @property
    def effective_margin_ms(self) -> float:
        if self.margin_ms is not None:
            return self.margin_ms
        return max(DEFAULT_MARGIN_FRACTION * self.p95_ms, MIN_DEFAULT_MARGIN_MS)


@dataclass(frozen=True, kw_only=True)
class DelayRecommendation:
    delay_us: int
    expected_batch: float
    """The batch the delay makes at the arrival rate."""
    step_ms: float
    """The step time of that batch."""
    margin_ms: float
    meets_objective: bool
    """False when even the lowest allowed delay leaves no room for the step and the margin."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class PreferredBatch:
    size: int
    knee: float | None
    reason: str


def expected_batch(
    step: steptimes.StepTimeModel, *, rate_per_second: float, delay_seconds: float, max_batch: int
) -> float:
    """The least fixed point of `b = clamp(rate * (delay + t_step(b)), 1, max_batch)`.

    Iterating from 1 climbs to it, since the right-hand side grows with b; when it has no fixed
    point below max_batch (the device cannot keep up) the batch is max_batch."""
    batch = 1.0
    for _ in range(_FIXED_POINT_ITERATIONS):
        collected = rate_per_second * (delay_seconds + step.ms(batch) / 1000.0)
        following = min(max(collected, 1.0), float(max_batch))
        if abs(following - batch) < 1e-6:
            return following
        batch = following
    return batch


def queue_delay(
    step: steptimes.StepTimeModel,
    objective: Objective,
    *,
    rate_per_second: float,
    max_batch: int,
) -> DelayRecommendation:
    margin = objective.effective_margin_ms

    def spent_ms(delay_us: float) -> tuple[float, float, float]:
        """Latency budgeted at this delay: (delay + step + margin, batch, step)."""
        batch = expected_batch(
            step,
            rate_per_second=rate_per_second,
            delay_seconds=delay_us / 1e6,
            max_batch=max_batch,
        )
        step_ms = step.ms(batch)
        return delay_us / 1000.0 + step_ms + margin, batch, step_ms

    low, high = float(objective.min_delay_us), float(objective.max_delay_us)
    spent_low, batch, step_ms = spent_ms(low)
    if spent_low > objective.p95_ms:
        delay = objective.min_delay_us
        meets = False
        bound = "the lowest allowed delay"
    else:
        spent_high, batch_high, step_high = spent_ms(high)
        if spent_high <= objective.p95_ms:
            low, batch, step_ms = high, batch_high, step_high
            bound = "capped at the highest allowed delay"
        else:
            for _ in range(_BISECTION_ITERATIONS):
                middle = (low + high) / 2
                spent, middle_batch, middle_step = spent_ms(middle)
                if spent <= objective.p95_ms:
                    low, batch, step_ms = middle, middle_batch, middle_step
                else:
                    high = middle
            bound = f"within [{objective.min_delay_us}, {objective.max_delay_us}] us"
        delay = math.floor(low)
        meets = True
    reason = (
        f"p95 objective {objective.p95_ms:g} ms - step {step_ms:.2f} ms (batch {batch:.1f} at "
        f"{rate_per_second:.4g}/s) - margin {margin:.3g} ms -> {delay} us, {bound}"
    )
    if not meets:
        reason += "; the objective cannot be met at this load"
    return DelayRecommendation(
        delay_us=delay,
        expected_batch=batch,
        step_ms=step_ms,
        margin_ms=margin,
        meets_objective=meets,
        reason=reason,
    )


def memory_cap(*, free_bytes: float, bytes_per_item: float) -> int:
    """The largest batch whose items fit in the free memory, with headroom; at least 1."""
    if bytes_per_item <= 0:
        raise ValueError("bytes per item must be positive")
    return max(1, math.floor(MEMORY_HEADROOM * free_bytes / bytes_per_item))


def preferred_batch(
    step: steptimes.StepTimeModel, *, max_batch: int, memory_cap: int | None = None
) -> PreferredBatch:
    cap = min(max_batch, memory_cap) if memory_cap is not None else max_batch
    capped_by = "the free GPU memory" if cap < max_batch else "max_batch_size"
    knee = step.knee()
    if knee is None:
        return PreferredBatch(
            size=cap, knee=None, reason=f"the step time does not grow with the batch: {capped_by}"
        )
    rounded = 2 ** round(math.log2(max(knee, 1.0)))
    if rounded > cap:
        return PreferredBatch(
            size=cap, knee=knee, reason=f"knee at {knee:.1f}, capped by {capped_by} ({cap})"
        )
    return PreferredBatch(
        size=rounded,
        knee=knee,
        reason=f"knee at {knee:.1f} (t0 = c * b^alpha), rounded to a power of two",
    )
