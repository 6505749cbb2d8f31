"""Load signals from batchpilot sidecars: every sidecar's /status, read at once and aggregated.

A sidecar reports, per model, what Triton counted over its rate window (its /status document,
`batchpilot_triton.reports`, read with the very model the sidecar writes it from); those counts
become `scraping.ModelRates` again, so the signals are aggregated by the very function that
aggregates Triton's own pages (`aggregating.signals_from_rates`), and so are the LLM engine's
figures a sidecar reports under `llm` (TTFT, inter-token latency, tokens, waiting sequences).
Only measured latency quantiles count (a sidecar's estimates are shown on its /status, not fed
to load rules). The recommended queue delay is the smallest over the governed models and
servers: the one delay a policy applies must meet the objective on every one of them. For LLM
engines the same holds of the recommended maxNumSeqs (the smallest) and maxNumBatchedTokens (the
largest: each server's is the least that prefills in time there); those are shown, never
applied.

A sidecar that does not answer, answers nonsense, or has stale data is named in the reading's
problems and contributes nothing, never zeros. The operator reads sidecars the same way. A
sidecar is a Pod of the policy's namespace, so its answer is read like any other server's a
policy names (`batchpilot_triton.responses`): under a total deadline, up to a size cap, and an
error is told by its status and reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence

import aiohttp
import pydantic

from batchpilot.api.v1alpha1 import specs
from batchpilot.policy import decisions
from batchpilot.signals import aggregating, sources
from batchpilot_triton import reports, responses, scraping

STATUS_DOCUMENT = pydantic.TypeAdapter(reports.StatusDocument)
"""Validates a sidecar's /status against the model the sidecar writes it from."""


def objective_query(slo: specs.Slo | None) -> dict[str, str]:
    """The /status query that asks a sidecar for recommendations under this objective."""
    if slo is None:
        return {}
    # The delay bounds mean nothing to a sidecar without the objective they serve.
    queue = slo.p95_latency_ms is not None
    return reports.ObjectiveQuery(
        slo_p95_ms=slo.p95_latency_ms,
        min_delay_us=slo.min_queue_delay_microseconds if queue else None,
        max_delay_us=slo.max_queue_delay_microseconds if queue else None,
        ttft_p95_ms=slo.ttft_p95_ms,
        itl_p95_ms=slo.itl_p95_ms,
    ).to_query()


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
        timeout: float = responses.SIDECAR_DEADLINE_SECONDS,
        limit: int = responses.STATUS_BYTES,
        known_problems: Sequence[str] = (),
    ) -> None:
        self._urls = [url.rstrip("/") for url in sidecar_urls]
        self._known_problems = tuple(known_problems)
        self._models = models
        self._query = objective_query(slo)
        self._timeout = timeout
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    async def read(self) -> sources.Reading:
        found = await asyncio.gather(
            *(self._status(url) for url in self._urls), return_exceptions=True
        )
        per_server: dict[str, Mapping[str, scraping.ModelRates]] = {}
        engines: dict[str, Mapping[str, reports.LlmReport]] = {}
        gpu_utilization: list[float] = []
        delays: list[int] = []
        llm_seqs: list[int] = []
        llm_tokens: list[int] = []
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
            engines[url] = status.llm_reports()
            gpu_utilization.extend(status.gpu_utilization())
            delays.extend(status.recommended_delays(self._models))
            seqs, tokens = status.recommended_llm_limits(self._models)
            llm_seqs.extend(seqs)
            llm_tokens.extend(tokens)
        signals = aggregating.signals_from_rates(
            per_server.values(),
            models=self._models,
            gpu_utilization=gpu_utilization,
            engines=engines.values(),
        )
        recommended = {
            decisions.RECOMMENDED_QUEUE_DELAY: min(delays, default=None),
            decisions.RECOMMENDED_MAX_NUM_SEQS: min(llm_seqs, default=None),
            decisions.RECOMMENDED_MAX_NUM_BATCHED_TOKENS: max(llm_tokens, default=None),
        }
        given = {name: float(value) for name, value in recommended.items() if value is not None}
        if given:
            signals = decisions.Signals(metrics={**signals.metrics, **given})
        return sources.Reading(
            signals=signals,
            per_server=per_server,
            engines_per_server=engines,
            problems=tuple(problems),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _status(self, url: str) -> reports.StatusDocument:
        if self._session is None:
            self._session = responses.client_session(
                connector=aiohttp.TCPConnector(limit=responses.READS_AT_ONCE),
                timeout=aiohttp.ClientTimeout(total=self._timeout),
            )
        try:
            async with self._session.get(f"{url}/status", params=self._query) as response:
                if response.status != 200:
                    refused = responses.refusal(response.status, response.reason)
                    raise SidecarError(f"sidecar {url}: {refused}")
                body = await responses.read_capped(response, self._limit)
        except TimeoutError:
            raise SidecarError(f"sidecar {url}: no answer within {self._timeout:g}s") from None
        except aiohttp.ClientError as error:
            raise SidecarError(f"sidecar {url}: {responses.client_error_text(error)}") from None
        try:
            return STATUS_DOCUMENT.validate_json(body)
        except pydantic.ValidationError as error:
            # The first problem's place and kind; pydantic's message would quote the input.
            first = error.errors(include_input=False, include_url=False)[0]
            place = ".".join(str(part) for part in first["loc"]) or "the document"
            raise SidecarError(
                f"sidecar {url}: not a sidecar status ({error.error_count()} problems; "
                f"{place}: {responses.excerpt(first['msg'], 80)})"
            ) from None
