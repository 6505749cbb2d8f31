"""Load signals from a Prometheus server (`spec.load.source: prometheus`).

For fleets that already scrape Triton: the operator asks Prometheus instead of every Pod. The
queries select a policy's targets by the `namespace` and `pod` labels that Kubernetes service
discovery puts on scraped series (kube-prometheus-stack's PodMonitors and ServiceMonitors do),
and its models by Triton's own `model` label. The reductions match the sidecar and Triton
sources: counts and rates summed, p95 the worst, queue time weighted, GPU utilization averaged;
an LLM engine's TTFT and inter-token p95s are `histogram_quantile` over the rate of its buckets,
per replica and model, the worst of them. Series are named as `batchpilot_triton` names them for
the other sources, so all three read the same families.
"""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from batchpilot.policy import decisions
from batchpilot.signals import sources
from batchpilot_triton import engine_metrics, responses, scraping

# Series batchpilot reads; the recommendation is the sidecar's own gauge.
RECOMMENDATION = "batchpilot_sidecar_recommended_queue_delay_microseconds"


_REGEX_ESCAPED = frozenset(string.punctuation) - {"-", "_"}


def _string(value: str) -> str:
    """`value` inside a PromQL double-quoted string: Go's escapes, of which JSON's are a part."""
    return json.dumps(value, ensure_ascii=False)[1:-1]


def _regex_literal(value: str) -> str:
    """`value` as a literal inside a PromQL regex string: RE2 escapes (ASCII punctuation is the
    only thing RE2 lets a backslash escape; `-` and `_` need none), then PromQL's own."""
    escaped = "".join("\\" + char if char in _REGEX_ESCAPED else char for char in value)
    return _string(escaped)


def _matcher(namespace: str, pods: Sequence[str], models: Sequence[str]) -> str:
    def alternatives(values: Sequence[str]) -> str:
        return "|".join(_regex_literal(value) for value in values)

    labels = [f'namespace="{_string(namespace)}"', f'pod=~"{alternatives(pods)}"']
    if models:
        labels.append(f'model=~"{alternatives(models)}"')
    return ",".join(labels)


def queries(
    *, namespace: str, pods: Sequence[str], models: Sequence[str], window: str
) -> dict[str, str]:
    """The PromQL behind each signal, for a policy's targets and models."""
    selected = _matcher(namespace, pods, models)
    pod_only = _matcher(namespace, pods, ())
    requests = f"sum(rate({scraping.REQUEST_SUCCESS}{{{selected}}}[{window}]))"
    failures = f"(sum(rate({scraping.REQUEST_FAILURE}{{{selected}}}[{window}])) or vector(0))"

    def worst_p95_ms(histogram: str) -> str:
        # Each replica's model's p95 over the window (its versions' buckets added), the worst.
        buckets = f"rate({histogram}_bucket{{{selected}}}[{window}])"
        return f"max(histogram_quantile(0.95, sum by (pod, model, le) ({buckets}))) * 1000"

    return {
        "requestRate": f"{requests} + {failures}",
        "queueDepth": f"sum({scraping.PENDING}{{{selected}}})",
        "p95LatencyMs": f'max({scraping.REQUEST_SUMMARY_US}{{{selected},quantile="0.95"}}) / 1000',
        "queueTimeMs": (
            f"sum(rate({scraping.QUEUE_DURATION_US}{{{selected}}}[{window}])) / {requests} / 1000"
        ),
        "gpuUtilization": f"avg({scraping.GPU_UTILIZATION}{{{pod_only}}}) * 100",
        "ttftP95Ms": worst_p95_ms(engine_metrics.TTFT_SECONDS),
        "interTokenP95Ms": worst_p95_ms(engine_metrics.ITL_SECONDS),
        "outputTokensPerSecond": (
            f"sum(rate({engine_metrics.GENERATION_TOKENS}{{{selected}}}[{window}]))"
        ),
        "waitingSequences": f"sum({engine_metrics.WAITING}{{{selected}}})",
        decisions.RECOMMENDED_QUEUE_DELAY: f"min({RECOMMENDATION}{{{selected}}})",
    }


class PrometheusSource:
    """The policy's queries, asked of its Prometheus at once, under one deadline.

    Read with aiohttp on the event loop: the deadline cancels each request whole (connect,
    headers, body), nothing waits in a thread pool that other policies share, and the name of
    the server is looked up on a thread of this source's own
    (`responses.OwnThreadResolver`). prometheus-api-client, used here before, runs `requests`
    in threads: its timeout bounds each socket read, not the answer, so a server trickling
    bytes held those threads (and the pool the Kubernetes calls run in) for as long as it
    liked, and its errors carried the answer's body.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        pods: Sequence[str],
        models: Sequence[str],
        window: str = "1m",
        timeout: float = responses.PROMETHEUS_DEADLINE_SECONDS,
        limit: int = responses.PROMETHEUS_BYTES,
    ) -> None:
        self._endpoint = url.rstrip("/") + "/api/v1/query"
        self._title = _without_credentials(url)
        self._deadline = timeout
        self._limit = limit
        self._queries = queries(namespace=namespace, pods=pods, models=models, window=window)
        self._session: aiohttp.ClientSession | None = None
        self._resolver: responses.OwnThreadResolver | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created in the running loop; a few connections, enough for a tick's queries.
        if self._session is None:
            self._resolver = responses.OwnThreadResolver()  # the connector does not close it
            self._session = responses.client_session(
                connector=aiohttp.TCPConnector(limit=4, resolver=self._resolver),
                # read() holds the deadline; this only keeps a stray request from outliving it.
                timeout=aiohttp.ClientTimeout(total=2 * self._deadline),
            )
        return self._session

    async def _query(self, promql: str) -> float | None:
        params = {"query": promql, "timeout": f"{self._deadline:g}s"}
        async with self._client().get(self._endpoint, params=params) as response:
            if response.status != 200:
                raise PrometheusRefused(responses.refusal(response.status, response.reason))
            body = await responses.read_capped(response, self._limit)
        return _value(body)

    async def read(self) -> sources.Reading:
        if not self._queries:
            return sources.Reading(signals=decisions.Signals())
        asked = {
            asyncio.ensure_future(self._query(promql)): name
            for name, promql in self._queries.items()
        }
        try:
            done, late = await asyncio.wait(asked, timeout=self._deadline)
        finally:
            # Late or not, when the tick gives up on the read: no query outlives it.
            unfinished = [task for task in asked if not task.done()]
            for task in unfinished:
                task.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
        metrics: dict[str, float] = {}
        problems: list[str] = []
        if late:
            problems.append(
                f"prometheus {self._title}: {len(late)} of {len(asked)} queries unanswered "
                f"within {self._deadline:g}s"
            )
        for task in done:
            error = task.exception()
            if error is None:
                answer = task.result()
                if answer is not None:
                    metrics[asked[task]] = answer
            elif isinstance(error, aiohttp.ClientError):
                message = responses.client_error_text(error)
                problems.append(f"prometheus {self._title}: {asked[task]}: {message}")
            elif isinstance(error, PrometheusRefused | TimeoutError):
                message = responses.excerpt(str(error)) or type(error).__name__
                problems.append(f"prometheus {self._title}: {asked[task]}: {message}")
            else:
                raise error
        return sources.Reading(signals=decisions.Signals(metrics), problems=tuple(problems[:1]))

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        if self._resolver is not None:
            resolver, self._resolver = self._resolver, None
            await resolver.close()


class PrometheusRefused(Exception):
    """Prometheus answered, but not with a result (its status and reason, never its body)."""


def _value(body: bytes) -> float | None:
    """The number in an instant query's answer; None when it has none (no series, NaN)."""
    try:
        document = json.loads(body)
        result = document["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
    except (ValueError, TypeError, KeyError, IndexError):
        raise PrometheusRefused("not an instant query answer") from None
    return None if value != value else value  # NaN: no data, e.g. 0/0


def _without_credentials(url: str) -> str:
    """The URL as problems show it: no user or password it may carry, no query."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
