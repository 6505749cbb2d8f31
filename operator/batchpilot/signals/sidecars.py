"""Load signals from batchpilot sidecars: every sidecar's /status, read at once and aggregated.

A sidecar reports, per model, what Triton counted over its rate window; those counts become
`scraping.ModelRates` again, so the signals are aggregated by the very function that aggregates
Triton's own pages (`aggregating.signals_from_rates`). Only measured latency quantiles count
(a sidecar's estimates are shown on its /status, not fed to load rules). The recommended queue
delay is the smallest over the governed models and servers: the one delay a policy applies must
meet the objective on every one of them.

A sidecar that does not answer, answers nonsense, or has stale data is named in the reading's
problems and contributes nothing, never zeros. The operator reads sidecars the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence

import aiohttp
import pydantic
from pydantic.alias_generators import to_camel

from batchpilot.policy import decisions, specs
from batchpilot.signals import aggregating, sources
from batchpilot_triton import scraping


class _Document(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(alias_generator=to_camel, extra="ignore", frozen=True)


class _Window(_Document):
    seconds: float
    requests_succeeded: float
    requests_failed: float
    inferences: float
    executions: float
    request_us: float
    queue_us: float
    compute_infer_us: float
    pending_requests: float


class _Latency(_Document):
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    source: str


class _QueueDelay(_Document):
    status: str
    microseconds: int | None = None


class _Recommendation(_Document):
    status: str
    queue_delay: _QueueDelay | None = None


class _Model(_Document):
    window: _Window | None = None
    latency_ms: _Latency | None = None
    recommendation: _Recommendation | None = None


class _Device(_Document):
    utilization: float | None = None


class _Gpu(_Document):
    status: str
    devices: list[_Device] = []


class SidecarStatus(_Document):
    """The part of a sidecar's /status document that load signals need."""

    fresh: bool
    gpu: _Gpu
    models: dict[str, _Model]

    def rates(self) -> dict[str, scraping.ModelRates]:
        found = {}
        for name, model in self.models.items():
            window = model.window
            if window is None or window.seconds <= 0:
                continue
            measured = (
                model.latency_ms
                if model.latency_ms and model.latency_ms.source == "summary"
                else None
            )
            found[name] = scraping.ModelRates(
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
        return found

    def recommended_delays(self, models: Collection[str]) -> list[int]:
        delays = []
        for name, model in self.models.items():
            if models and name not in models:
                continue
            delay = model.recommendation.queue_delay if model.recommendation else None
            if delay is not None and delay.status == "ok" and delay.microseconds is not None:
                delays.append(delay.microseconds)
        return delays

    def gpu_utilization(self) -> list[float]:
        return [d.utilization for d in self.gpu.devices if d.utilization is not None]


def objective_query(slo: specs.Slo | None) -> dict[str, str]:
    """The /status query that asks a sidecar for recommendations under this objective."""
    if slo is None:
        return {}
    return {
        "sloP95Ms": f"{slo.p95_latency_ms:g}",
        "minDelayUs": str(slo.min_queue_delay_microseconds),
        "maxDelayUs": str(slo.max_queue_delay_microseconds),
    }


class SidecarError(Exception):
    """A sidecar did not answer, or not with a status document."""


class SidecarSource:
    """Signals from the sidecars next to the governed Triton servers."""

    def __init__(
        self,
        sidecar_urls: Sequence[str],
        *,
        models: Collection[str],
        slo: specs.Slo | None,
        timeout: float = 2.0,
        known_problems: Sequence[str] = (),
    ) -> None:
        self._urls = [url.rstrip("/") for url in sidecar_urls]
        self._known_problems = tuple(known_problems)
        self._models = models
        self._query = objective_query(slo)
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def read(self) -> sources.Reading:
        found = await asyncio.gather(
            *(self._status(url) for url in self._urls), return_exceptions=True
        )
        per_server: dict[str, Mapping[str, scraping.ModelRates]] = {}
        gpu_utilization: list[float] = []
        delays: list[int] = []
        problems = list(self._known_problems)
        for url, status in zip(self._urls, found, strict=True):
            if isinstance(status, BaseException):
                if not isinstance(status, SidecarError):
                    raise status
                problems.append(str(status))
                continue
            if not status.fresh:
                problems.append(f"sidecar {url}: its Triton readings are stale; left out")
                continue
            per_server[url] = status.rates()
            gpu_utilization.extend(status.gpu_utilization())
            delays.extend(status.recommended_delays(self._models))
        signals = aggregating.signals_from_rates(
            per_server.values(), models=self._models, gpu_utilization=gpu_utilization
        )
        if delays:
            metrics = {**signals.metrics, decisions.RECOMMENDED_QUEUE_DELAY: float(min(delays))}
            signals = decisions.Signals(metrics=metrics)
        return sources.Reading(signals=signals, per_server=per_server, problems=tuple(problems))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _status(self, url: str) -> SidecarStatus:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout)
            )
        try:
            async with self._session.get(f"{url}/status", params=self._query) as response:
                response.raise_for_status()
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise SidecarError(f"sidecar {url}: {error or type(error).__name__}") from None
        try:
            return SidecarStatus.model_validate_json(body)
        except pydantic.ValidationError as error:
            raise SidecarError(f"sidecar {url}: not a sidecar status: {error}") from None
