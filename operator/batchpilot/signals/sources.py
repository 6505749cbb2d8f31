"""Where load signals come from: Triton's own metrics pages, or the sidecars next to Triton
(`batchpilot.signals.sidecars`), behind one `read() -> Reading` shape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from batchpilot.policy import decisions
from batchpilot.signals import aggregating
from batchpilot_triton import reports, responses, scraping, servers


@dataclass(frozen=True)
class Reading:
    """Signals for the engine, and the per-server details they came from."""

    signals: decisions.Signals
    per_server: Mapping[str, Mapping[str, scraping.ModelRates]] = field(default_factory=dict)
    engines_per_server: Mapping[str, Mapping[str, reports.LlmReport]] = field(default_factory=dict)
    """What the LLM engines behind each server's models measured (TTFT, inter-token latency),
    by the same URLs as `per_server`."""
    problems: tuple[str, ...] = ()


class SignalSource(Protocol):
    async def read(self) -> Reading: ...

    async def close(self) -> None: ...


class TritonMetricsSource:
    """Signals straight from each Triton server's metrics page.

    Rates need two pages, so the first reading after start (or after a server was unreachable)
    has no rate-based signals for that server."""

    def __init__(
        self,
        triton_servers: Sequence[servers.TritonServer],
        *,
        models: Collection[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._servers = list(triton_servers)
        self._models = models
        self._clock = clock
        self._previous: dict[str, scraping.Snapshot] = {}

    async def read(self) -> Reading:
        at_once = asyncio.Semaphore(responses.READS_AT_ONCE)

        async def parsed_page(server: servers.TritonServer) -> scraping.Snapshot:
            async with at_once:
                return await server.metrics_snapshot(self._clock)

        snapshots = await asyncio.gather(
            *(parsed_page(server) for server in self._servers), return_exceptions=True
        )
        per_server: dict[str, Mapping[str, scraping.ModelRates]] = {}
        gpu_utilization: list[float] = []
        problems: list[str] = []
        for server, snapshot in zip(self._servers, snapshots, strict=True):
            if isinstance(snapshot, BaseException):
                if not isinstance(snapshot, servers.TritonError):
                    raise snapshot
                problems.append(str(snapshot))
                self._previous.pop(server.url, None)
                continue
            gpu_utilization.extend(snapshot.gpu_values(scraping.GPU_UTILIZATION))
            previous = self._previous.get(server.url)
            self._previous[server.url] = snapshot
            if previous is not None:
                per_server[server.url] = scraping.rates(previous, snapshot)
        engines = {url: aggregating.engine_reports(rates) for url, rates in per_server.items()}
        signals = aggregating.signals_from_rates(
            per_server.values(),
            models=self._models,
            gpu_utilization=gpu_utilization,
            engines=engines.values(),
        )
        return Reading(
            signals=signals,
            per_server=per_server,
            engines_per_server=engines,
            problems=tuple(problems),
        )

    async def close(self) -> None:
        """The servers belong to the caller, which closes them."""
