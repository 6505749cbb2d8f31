"""How long one execution of a batch takes: fitting `t_step(b) = t0 + c * b**alpha`.

A GPU step has a fixed cost (kernel launches, reading the weights) and a part that grows with the
batch, usually sub-linearly while the device has idle lanes; three numbers describe it well
enough to predict latency and to find where larger batches stop paying.

The points come from Triton's statistics extension: exact per-batch-size execution counts and
cumulative compute time, so each observation is the mean step of one exact batch size over one
collection interval. Triton's compute time includes waiting for a device that other instances
hold, and the first executions after a load are slow, so the observations of one batch size are
reduced to their weighted median before the curve is fitted, and the fit itself is robust:
iteratively reweighted least squares with Huber weights. For a given alpha, t0 and c are a
weighted linear least-squares problem, so alpha is searched on a grid (vectorised over all grid
values at once) that is refined around the best value.

Alpha trades off against t0 and c when the batch sizes seen are few or close together, so a fit
needs several distinct sizes spanning a factor of several; until then the result says what is
missing instead of guessing.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MIN_BATCH_SIZES = 4
"""Distinct batch sizes a fit needs."""
MIN_SPAN = 4.0
"""How many times the largest batch size seen must exceed the smallest."""
MIN_EXECUTIONS = 3
"""Executions of one batch size before it counts as seen."""

# Below about 0.2, b**alpha hardly varies over the batch sizes seen and becomes a second
# intercept: a flat step time would be fitted as one with no fixed cost at all.
MIN_ALPHA = 0.2
MAX_ALPHA = 2.0
_ALPHA_GRID = np.linspace(MIN_ALPHA, MAX_ALPHA, 37)
_REFINEMENTS = 2
_HUBER_K = 1.345  # 95% efficiency under Gaussian noise
_IRLS_ITERATIONS = 20
_OUTLIER_WEIGHT = 0.5

Vector = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True)
class Observation:
    """Executions of one batch size during one collection interval."""

    batch_size: int
    executions: int
    mean_ms: float


@dataclass(frozen=True, kw_only=True)
class StepTimeModel:
    t0_ms: float
    c_ms: float
    alpha: float

    def ms(self, batch_size: float) -> float:
        return self.t0_ms + self.c_ms * math.pow(batch_size, self.alpha)

    def knee(self) -> float | None:
        """The batch size at which the part that grows with the batch costs as much as the fixed
        part: below it, batching is nearly free; above it, items cost more than launches.
        None when the step time does not grow with the batch."""
        if self.c_ms <= 0 or self.alpha <= 0:
            return None
        if self.t0_ms <= 0:
            return 1.0
        return float((self.t0_ms / self.c_ms) ** (1.0 / self.alpha))


@dataclass(frozen=True, kw_only=True)
class Point:
    batch_size: int
    median_ms: float
    executions: int


@dataclass(frozen=True, kw_only=True)
class Fit:
    model: StepTimeModel
    r_squared: float
    """Coefficient of determination over the per-batch-size medians, weighted as the fit weighs
    them (outliers discounted)."""
    rmse_ms: float
    """Root-mean-square residual over the per-batch-size medians."""
    batch_sizes: tuple[int, ...]
    executions: int
    outliers: tuple[int, ...]
    """Batch sizes whose medians the robust weights mostly discounted."""
    points: tuple[Point, ...] = ()
    """What was fitted: per batch size, the median step time and the executions behind it."""

    @property
    def span(self) -> float:
        return self.batch_sizes[-1] / self.batch_sizes[0]


@dataclass(frozen=True, kw_only=True)
class NotEnoughData:
    reason: str
    batch_sizes: tuple[int, ...]
    """The batch sizes seen often enough so far."""


def fit(
    observations: Iterable[Observation],
    *,
    min_batch_sizes: int = MIN_BATCH_SIZES,
    min_span: float = MIN_SPAN,
    min_executions: int = MIN_EXECUTIONS,
    named: str = "batch sizes",
) -> Fit | NotEnoughData:
    """The robust fit of the observations, or what is missing; `named` is what the batch sizes
    are called in that message (an LLM engine's are running-sequence counts)."""
    by_size: defaultdict[int, list[Observation]] = defaultdict(list)
    for observation in observations:
        if observation.executions > 0 and math.isfinite(observation.mean_ms):
            by_size[observation.batch_size].append(observation)
    counts = {size: sum(o.executions for o in seen) for size, seen in by_size.items()}
    sizes = tuple(sorted(size for size, count in counts.items() if count >= min_executions))
    if len(sizes) < min_batch_sizes:
        return NotEnoughData(
            reason=f"{len(sizes)} distinct {named} seen at least {min_executions} times"
            f"{_listing(sizes)}; a fit needs {min_batch_sizes} spanning at least {min_span:g}x",
            batch_sizes=sizes,
        )
    if sizes[-1] / sizes[0] < min_span:
        return NotEnoughData(
            reason=f"{named} seen span {sizes[-1] / sizes[0]:.2g}x{_listing(sizes)}; "
            f"a fit needs at least {min_span:g}x",
            batch_sizes=sizes,
        )
    b = np.array(sizes, dtype=np.float64)
    y = np.array([_weighted_median(by_size[size]) for size in sizes])
    n = np.array([counts[size] for size in sizes], dtype=np.float64)
    # A per-size median's error is not only sampling noise (contention and overheads drift), so
    # executions beyond a few add less than their number claims: weigh by the square root.
    weights = np.sqrt(n)
    robust = np.ones_like(y)
    for _ in range(_IRLS_ITERATIONS):
        alpha, t0, c = _best_alpha(b, y, weights * robust)
        residuals = y - (t0 + c * b**alpha)
        updated = _huber_weights(residuals, floor=1e-3 * float(np.median(y)))
        converged = np.allclose(updated, robust, atol=1e-4)
        robust = updated
        if converged:
            break
    # R^2 weighs the points as the fit does: one batch size that a hiccup threw off (named in
    # `outliers`) took it from 0.9987 to 0.52 for a curve within 8% at every size.
    fitted_weights = weights * robust
    alpha, t0, c = _best_alpha(b, y, fitted_weights)
    residuals = y - (t0 + c * b**alpha)
    mean = float(np.average(y, weights=fitted_weights))
    total = float(np.sum(fitted_weights * (y - mean) ** 2))
    explained = 1.0 - float(np.sum(fitted_weights * residuals**2)) / total if total > 0 else 1.0
    return Fit(
        model=StepTimeModel(t0_ms=t0, c_ms=c, alpha=alpha),
        r_squared=explained,
        rmse_ms=float(np.sqrt(np.mean(residuals**2))),
        batch_sizes=sizes,
        executions=int(n.sum()),
        outliers=tuple(
            size for size, weight in zip(sizes, robust, strict=True) if weight < _OUTLIER_WEIGHT
        ),
        points=tuple(
            Point(batch_size=size, median_ms=float(median), executions=counts[size])
            for size, median in zip(sizes, y, strict=True)
        ),
    )


def _listing(sizes: tuple[int, ...]) -> str:
    return f" ({', '.join(map(str, sizes))})" if sizes else ""


def _weighted_median(observations: list[Observation]) -> float:
    ordered = sorted(observations, key=lambda o: o.mean_ms)
    half = sum(o.executions for o in ordered) / 2
    running = 0
    for observation in ordered:
        running += observation.executions
        if running >= half:
            return observation.mean_ms
    return ordered[-1].mean_ms


def _huber_weights(residuals: Vector, *, floor: float) -> Vector:
    # The median absolute residual, scaled to a standard deviation under Gaussian noise; the
    # floor keeps noiseless data from dividing by zero.
    scale = max(1.4826 * float(np.median(np.abs(residuals))), floor)
    excess = np.abs(residuals) / (_HUBER_K * scale)
    weights: Vector = np.where(excess <= 1.0, 1.0, 1.0 / np.maximum(excess, 1.0))
    return weights


def _best_alpha(b: Vector, y: Vector, w: Vector) -> tuple[float, float, float]:
    grid = _ALPHA_GRID
    t0, c, loss = _solve(grid, b, y, w)
    for _ in range(_REFINEMENTS):
        best = int(np.argmin(loss))
        step = float(grid[1] - grid[0])
        grid = np.linspace(grid[best] - step, grid[best] + step, 41)
        grid = grid[(grid >= MIN_ALPHA) & (grid <= MAX_ALPHA)]
        t0, c, loss = _solve(grid, b, y, w)
    best = int(np.argmin(loss))
    return float(grid[best]), float(t0[best]), float(c[best])


def _solve(alphas: Vector, b: Vector, y: Vector, w: Vector) -> tuple[Vector, Vector, Vector]:
    """For every alpha at once: weighted least squares for t0 >= 0 and c >= 0, and its loss."""
    x = b[np.newaxis, :] ** alphas[:, np.newaxis]
    sw = w.sum()
    sx = (w * x).sum(axis=1)
    sy = float((w * y).sum())
    sxx = (w * x * x).sum(axis=1)
    sxy = (w * x * y).sum(axis=1)
    determinant = sw * sxx - sx**2
    safe = np.where(determinant > 0, determinant, 1.0)
    c = np.where(determinant > 0, (sw * sxy - sx * sy) / safe, 0.0)
    t0 = (sy - c * sx) / sw
    # On the boundary of the feasible set: a flat step time, or one with no fixed part.
    flat = c < 0
    c = np.where(flat, 0.0, c)
    t0 = np.where(flat, sy / sw, t0)
    proportional = t0 < 0
    c = np.where(proportional, sxy / sxx, c)
    t0 = np.where(proportional, 0.0, t0)
    residuals = y[np.newaxis, :] - t0[:, np.newaxis] - c[:, np.newaxis] * x
    loss = (w * residuals**2).sum(axis=1)
    return t0, c, loss
