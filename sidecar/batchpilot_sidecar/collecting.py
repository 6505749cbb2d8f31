"""The collection loop: what Triton and the GPUs did, per model, in bounded memory.

Every interval the collector takes three readings at once: Triton's metrics page (request,
inference and execution counts, queue and compute time, pending requests, latency quantiles),
Triton's statistics extension (executions and compute time per exact batch size: the points of
the step-time fit) and the GPUs. Rates are increases between two consecutive pages, as
`batchpilot_triton.scraping` computes them series by series.

For a model served by an LLM engine the metrics page also gives the engine's inter-token latency
and running sequences; every few seconds of them are a sample of the engine's step time against
its running sequences (`decodesteps`), fitted like the batch sizes are. With the model
repository (`model_repository`), the collector also knows the most sequences a vLLM engine runs
from its `model.json`; without it, only from the arguments batchpilot applied.

Memory is bounded whatever Triton serves. Each model keeps the per-interval rates of the last
`rate_window` seconds and at most `max_observations` step-time observations (and as many LLM
step samples) of the last `fit_window` seconds, in deques with a maximum length. At most
`max_models` models are tracked: a newcomer takes the place of the model idle the longest, and
only while it is busy itself and the other is not, so a server with more models than the limit
keeps its busy ones. A model gone from Triton's page is forgotten after `forget_after` seconds.

A failed reading is data too: every source keeps when it last succeeded and its last error, so
/status can say how fresh each number is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from batchpilot_sidecar import decodesteps, gpus, steptimes, threads
from batchpilot_triton import engine_metrics, modelconfigs, repositories, scraping, servers

logger = logging.getLogger("batchpilot.sidecar")

TRITON_METRICS = "triton_metrics"
TRITON_STATISTICS = "triton_statistics"
GPU = "gpu"
SOURCES = (TRITON_METRICS, TRITON_STATISTICS, GPU)

BatchTotals = Mapping[int, tuple[int, int]]
"""Per exact batch size: executions and nanoseconds of compute since the model loaded."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How often the collector reads, and how much it keeps (seconds, counts)."""

    interval: float = 1.0
    rate_window: float = 10.0
    fit_window: float = 600.0
    fit_every: float = 5.0
    """Refit at most this often (seconds); fitting is cheap, but not free at 1 Hz."""
    max_models: int = 64
    max_observations: int = 1024
    forget_after: float = 300.0
    config_every: float = 60.0
    """Re-read a model's config this often, and after its statistics reset (a reload)."""

    def __post_init__(self) -> None:
        for name in ("interval", "rate_window", "fit_window", "fit_every", "forget_after"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', ' ')} must be positive")
        if self.max_models < 1 or self.max_observations < 1:
            raise ValueError("the model and observation limits must be at least 1")


@dataclass(frozen=True, kw_only=True)
class SourceHealth:
    last_success: float | None = None
    """Monotonic seconds."""
    last_success_wall: float | None = None
    """Unix time."""
    last_error: str | None = None
    """The error of the last attempt; None when it succeeded."""
    successes: int = 0
    failures: int = 0

    def succeeded(self, now: float, wall: float) -> SourceHealth:
        return dataclasses.replace(
            self,
            last_success=now,
            last_success_wall=wall,
            last_error=None,
            successes=self.successes + 1,
        )

    def failed(self, error: str) -> SourceHealth:
        return dataclasses.replace(self, last_error=error, failures=self.failures + 1)


def batch_totals(model_stats: Iterable[Mapping[str, Any]]) -> dict[str, dict[int, tuple[int, int]]]:
    """Per model, per exact batch size: (executions, compute nanoseconds), over its versions."""
    totals: dict[str, dict[int, tuple[int, int]]] = {}
    for entry in model_stats:
        per_size = totals.setdefault(str(entry["name"]), {})
        for batch in entry.get("batch_stats", []):
            infer = batch["compute_infer"]
            size = int(batch["batch_size"])
            count, nanoseconds = per_size.get(size, (0, 0))
            per_size[size] = (count + int(infer["count"]), nanoseconds + int(infer["ns"]))
    return totals


def observations_between(before: BatchTotals, after: BatchTotals) -> list[steptimes.Observation]:
    """What executed between two statistics readings; a total that went down was reset by a
    reload, and counts from zero."""
    found = []
    for size, (count, nanoseconds) in sorted(after.items()):
        earlier_count, earlier_ns = before.get(size, (0, 0))
        if count < earlier_count or nanoseconds < earlier_ns:
            earlier_count, earlier_ns = 0, 0
        executions = count - earlier_count
        if executions > 0:
            mean_ms = (nanoseconds - earlier_ns) / executions / 1e6
            found.append(
                steptimes.Observation(batch_size=size, executions=executions, mean_ms=mean_ms)
            )
    return found


def _was_reset(before: BatchTotals, after: BatchTotals) -> bool:
    return any(after.get(size, (0, 0))[0] < count for size, (count, _) in before.items())


def sum_rates(intervals: Collection[scraping.ModelRates]) -> scraping.ModelRates | None:
    """Consecutive intervals as one: counts and seconds add up; gauges are the latest."""
    if not intervals:
        return None
    fields = [field.name for field in dataclasses.fields(scraping.ModelCounters)]
    counted = scraping.ModelCounters(
        **{name: sum(getattr(rates.counted, name) for rates in intervals) for name in fields}
    )
    latest = list(intervals)[-1]
    return dataclasses.replace(
        latest,
        seconds=sum(rates.seconds for rates in intervals),
        counted=counted,
        engine=engine_metrics.summed(rates.engine for rates in intervals),
    )


REPOSITORY_READ_SECONDS = 5.0
"""How long a read of the mounted model repository may be waited on (a hung volume must not
hold the collection loop; it holds one thread per model, `threads.OneAtATime`)."""


class ModelState:
    """One model's windows. Mutable, owned by the collector."""

    def __init__(self, name: str, *, settings: Settings, now: float) -> None:
        self.name = name
        self._settings = settings
        capacity = max(2, int(settings.rate_window / settings.interval) + 2)
        self.intervals: deque[tuple[float, scraping.ModelRates]] = deque(maxlen=capacity)
        self.observations: deque[tuple[float, steptimes.Observation]] = deque(
            maxlen=settings.max_observations
        )
        self.totals: BatchTotals | None = None
        self.step_time: steptimes.Fit | steptimes.NotEnoughData = steptimes.fit(())
        self.decode_pool = decodesteps.Pool()
        self.decode_samples: deque[tuple[float, decodesteps.Sample]] = deque(
            maxlen=settings.max_observations
        )
        self.decode_step_time: steptimes.Fit | steptimes.NotEnoughData = decodesteps.fit(())
        self.fitted_at: float | None = None
        self.fit_due = False
        """Observations came or went since the last fit (refits wait for `fit_every`)."""
        self.config: modelconfigs.ServedBatching | None = None
        self.config_read_at: float | None = None
        self.config_error: str | None = None
        self.config_stale = True
        self.last_seen = now
        self.last_active: float | None = None

    def add_interval(self, now: float, rates: scraping.ModelRates) -> None:
        """One interval's rates."""
        self.intervals.append((now, rates))
        engine = rates.engine
        if engine is not None:
            found = self.decode_pool.add(
                engine,
                seconds=rates.seconds,
                max_running=self.config.max_num_seqs if self.config is not None else None,
            )
            if found is not None:
                self.decode_samples.append((now, found))
                self.fit_due = True
        since = now - self._settings.fit_window
        while self.decode_samples and self.decode_samples[0][0] < since:
            self.decode_samples.popleft()
            self.fit_due = True

    def rates(self, now: float) -> scraping.ModelRates | None:
        """The intervals that ended within the rate window, as one."""
        since = now - self._settings.rate_window
        return sum_rates([rates for at, rates in self.intervals if at > since])

    def compute_ms_per_execution(self, now: float) -> float | None:
        """Mean compute time of the executions in the rate window, from the batch stats (the
        metrics page adds a batch's compute time to each of its requests)."""
        since = now - self._settings.rate_window
        recent = [observation for at, observation in self.observations if at > since]
        executions = sum(observation.executions for observation in recent)
        if not executions:
            return None
        return sum(o.executions * o.mean_ms for o in recent) / executions

    def add_totals(self, now: float, totals: BatchTotals) -> None:
        if self.totals is not None:
            if _was_reset(self.totals, totals):
                self.config_stale = True
                # A span across a reload would mix two engines, perhaps with different limits.
                self.decode_pool = decodesteps.Pool()
            for observation in observations_between(self.totals, totals):
                self.observations.append((now, observation))
                self.fit_due = True
        self.totals = dict(totals)
        since = now - self._settings.fit_window
        while self.observations and self.observations[0][0] < since:
            self.observations.popleft()
            self.fit_due = True

    def refit(self, now: float) -> None:
        self.step_time = steptimes.fit(observation for _, observation in self.observations)
        self.decode_step_time = decodesteps.fit(found for _, found in self.decode_samples)
        self.fitted_at = now
        self.fit_due = False

    def config_due(self, now: float) -> bool:
        return (
            self.config_stale
            or self.config_read_at is None
            or now - self.config_read_at >= self._settings.config_every
        )


class TritonReadings(Protocol):
    """What the collector reads from Triton; `servers.TritonServer` in production. Failures
    are raised as `servers.TritonError`."""

    @property
    def url(self) -> str: ...

    @property
    def metrics_url(self) -> str: ...

    async def metrics_text(self) -> str: ...

    async def statistics(self, model: str = "") -> list[dict[str, Any]]: ...

    async def model_config(self, model: str) -> dict[str, Any]: ...


class Collector:
    """Reads Triton and the GPUs every interval; holds the per-model windows."""

    def __init__(
        self,
        triton: TritonReadings,
        gpu_monitor: gpus.GpuMonitor,
        *,
        models: Collection[str] = (),
        settings: Settings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        model_repository: Path | None = None,
    ) -> None:
        self.triton = triton
        self.model_repository = model_repository
        self._repository_reads = threads.OneAtATime()
        """Triton's model repository, where this sidecar reads it: the `model.json` of models
        served by vLLM."""
        self.gpu_monitor = gpu_monitor
        self.wanted = frozenset(models)
        self.settings = settings or Settings()
        self.clock = clock
        self.wall_clock = wall_clock
        self.models: dict[str, ModelState] = {}
        self.untracked = 0
        """Models on Triton's last page that the model limit kept out."""
        self.evicted = 0
        self.health = {source: SourceHealth() for source in SOURCES}
        self.gpu = gpus.GpuTelemetry(source=None, reason="not read yet")
        self.summaries_enabled: bool | None = None
        self.started_wall = wall_clock()
        self.last_tick: float | None = None
        self._previous: scraping.Snapshot | None = None

    async def collect(self) -> None:
        """One round of readings."""
        page, stats, gpu = await asyncio.gather(
            self.triton.metrics_text(),
            self.triton.statistics(),
            self.gpu_monitor.read(),
            return_exceptions=True,
        )
        now, wall = self.clock(), self.wall_clock()
        for outcome in (page, stats):
            if isinstance(outcome, BaseException) and not isinstance(outcome, servers.TritonError):
                raise outcome
        if isinstance(page, BaseException):
            self._previous = None
            self._failed(TRITON_METRICS, page)
        else:
            self._take_page(page, now)
            self._succeeded(TRITON_METRICS, now, wall)
        if isinstance(stats, BaseException):
            self._failed(TRITON_STATISTICS, stats)
        else:
            for name, totals in batch_totals(stats).items():
                state = self.models.get(name)
                if state is not None:
                    state.add_totals(now, totals)
            self._succeeded(TRITON_STATISTICS, now, wall)
        if isinstance(gpu, BaseException):
            # NVML and DCGM are foreign code: whatever they raise, the GPU is unknown, no more.
            self.gpu = gpus.GpuTelemetry(source=None, reason=f"GPU reading failed: {gpu!r}")
            self._failed(GPU, gpu)
        else:
            if (gpu.available, gpu.reason) != (self.gpu.available, self.gpu.reason):
                if gpu.available:
                    logger.info("GPU telemetry from %s: %d GPUs", gpu.source, len(gpu.gpus))
                else:
                    logger.warning("GPU telemetry unavailable: %s", gpu.reason)
            self.gpu = gpu
            self._succeeded(GPU, now, wall)
        for state in self.models.values():
            if state.fit_due and (
                state.fitted_at is None or now - state.fitted_at >= self.settings.fit_every
            ):
                state.refit(now)
        await self._read_configs(now)
        self.last_tick = now

    async def run(self, stop: asyncio.Event) -> None:
        """Collect every interval until `stop` is set. A failing round is logged, never fatal:
        a sidecar that crashed would take its telemetry with it."""
        while not stop.is_set():
            started = self.clock()
            try:
                await self.collect()
            except Exception:
                logger.exception("collection failed")
            remaining = self.settings.interval - (self.clock() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(remaining, 0.0))

    def _take_page(self, page: str, now: float) -> None:
        snapshot = scraping.parse(page, taken_at=now)
        self.summaries_enabled = snapshot.summaries_enabled
        previous, self._previous = self._previous, snapshot
        present = {name for name in snapshot.models() if not self.wanted or name in self.wanted}
        per_model = scraping.rates(previous, snapshot) if previous is not None else {}
        busy = {name for name, rates in per_model.items() if rates.counted.requests > 0}
        for name in present & self.models.keys():
            state = self.models[name]
            state.last_seen = now
            if name in busy:
                state.last_active = now
        # Newcomers after the tracked models are marked, busy ones first.
        newcomers = sorted(present - self.models.keys(), key=lambda name: (name not in busy, name))
        self.untracked = sum(not self._admit(name, now, busy=name in busy) for name in newcomers)
        for name, rates in per_model.items():
            if name in self.models:
                self.models[name].add_interval(now, rates)
        forgotten = [
            name
            for name, state in self.models.items()
            if now - state.last_seen > self.settings.forget_after
        ]
        for name in forgotten:
            del self.models[name]

    def _admit(self, name: str, now: float, *, busy: bool) -> bool:
        if len(self.models) >= self.settings.max_models:
            if not busy:
                return False
            idlest = min(self.models.values(), key=lambda s: s.last_active or float("-inf"))
            if idlest.last_active == now:
                return False  # every tracked model is busy too
            del self.models[idlest.name]
            self.evicted += 1
        state = ModelState(name, settings=self.settings, now=now)
        state.last_active = now if busy else None
        self.models[name] = state
        return True

    async def _read_configs(self, now: float) -> None:
        due = [state for state in self.models.values() if state.config_due(now)]
        found = await asyncio.gather(
            *(self.triton.model_config(state.name) for state in due), return_exceptions=True
        )
        for state, config in zip(due, found, strict=True):
            state.config_read_at = now
            state.config_stale = False
            if isinstance(config, BaseException):
                if not isinstance(config, servers.TritonError):
                    raise config
                state.config_error = str(config)
            else:
                state.config = modelconfigs.ServedBatching.from_model_config(
                    config, model_json=await self._model_json(state.name, config)
                )
                state.config_error = None

    async def _model_json(self, model: str, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The repository's engine arguments of a model served by vLLM, if this sidecar reads
        the repository."""
        if self.model_repository is None or not modelconfigs.served_by_vllm(config):
            return None
        try:
            found = await self.read_repository_arguments(model)
        except (repositories.RepositoryError, TimeoutError) as error:
            logger.warning(
                "model %s: the most sequences its engine runs are unknown: %s", model, error
            )
            return None
        return found.arguments

    async def read_repository_arguments(self, model: str) -> repositories.RepositoryArguments:
        """A model's engine arguments from the mounted repository (the collection loop and
        /engine-arguments share one read per model), or TimeoutError after
        `REPOSITORY_READ_SECONDS`."""
        if self.model_repository is None:
            raise repositories.RepositoryError("this sidecar reads no model repository")
        try:
            return await self._repository_reads.call(
                model,
                REPOSITORY_READ_SECONDS,
                repositories.read_repository_arguments,
                self.model_repository,
                model,
            )
        except TimeoutError:
            raise TimeoutError(
                f"reading model {model}'s engine arguments took over {REPOSITORY_READ_SECONDS:g} s"
            ) from None

    def _succeeded(self, source: str, now: float, wall: float) -> None:
        self.health[source] = self.health[source].succeeded(now, wall)

    def _failed(self, source: str, error: BaseException) -> None:
        if self.health[source].last_error != str(error):
            logger.warning("%s: %s", source, error)
        self.health[source] = self.health[source].failed(str(error))
