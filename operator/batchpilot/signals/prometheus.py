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

from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests import RequestException, Session
from urllib3.util.retry import Retry

from batchpilot.policy import decisions
from batchpilot.signals import sources
from batchpilot_triton import engine_metrics, scraping

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
    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        pods: Sequence[str],
        models: Sequence[str],
        window: str = "1m",
        timeout: float = 5.0,
    ) -> None:
        # Our own session, so close() can release its connections when the policy goes.
        self._session = Session()
        # One quick retry at most: a tick that cannot read Prometheus reports it and moves on.
        self._client = PrometheusConnect(
            url=url,
            disable_ssl=False,
            timeout=int(timeout) or 1,
            retry=Retry(total=1),
            session=self._session,
        )
        self._url = url
        self._timeout = timeout
        self._queries = queries(namespace=namespace, pods=pods, models=models, window=window)

    def _query(self, promql: str) -> float | None:
        result = self._client.custom_query(promql, params={"timeout": f"{self._timeout:g}s"})
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN: no data, e.g. 0/0

    async def read(self) -> sources.Reading:
        if not self._queries:
            return sources.Reading(signals=decisions.Signals())
        names = list(self._queries)
        answers = await asyncio.gather(
            *(asyncio.to_thread(self._query, self._queries[name]) for name in names),
            return_exceptions=True,
        )
        metrics: dict[str, float] = {}
        problems: list[str] = []
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, PrometheusApiClientException | RequestException):
                problems.append(f"prometheus {self._url}: {name}: {answer}")
            elif isinstance(answer, BaseException):
                raise answer
            elif answer is not None:
                metrics[name] = answer
        return sources.Reading(signals=decisions.Signals(metrics), problems=tuple(problems[:1]))

    async def close(self) -> None:
        self._session.close()
