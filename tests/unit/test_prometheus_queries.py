"""The PromQL behind `spec.load.source: prometheus`: one query per load signal, for a policy's
Pods and models (a real Prometheus answers them in tests/integration/test_prometheus_signals.py)."""

from __future__ import annotations

import json
import re

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.policy import decisions
from batchpilot.signals import prometheus

SELECTED = 'namespace="chat",pod=~"triton-0|triton-1",model=~"tiny_llm"'


def chat_queries() -> dict[str, str]:
    return prometheus.queries(
        namespace="chat", pods=["triton-0", "triton-1"], models=["tiny_llm"], window="1m"
    )


def test_every_load_metric_and_the_recommendation_have_a_query() -> None:
    assert set(chat_queries()) == {*specs.LOAD_METRICS, decisions.RECOMMENDED_QUEUE_DELAY}


def test_llm_latencies_are_each_replica_s_histogram_p95_the_worst_in_milliseconds() -> None:
    queries = chat_queries()
    assert queries["ttftP95Ms"] == (
        "max(histogram_quantile(0.95, sum by (pod, model, le) "
        f"(rate(vllm:time_to_first_token_seconds_bucket{{{SELECTED}}}[1m])))) * 1000"
    )
    assert queries["interTokenP95Ms"] == (
        "max(histogram_quantile(0.95, sum by (pod, model, le) "
        f"(rate(vllm:inter_token_latency_seconds_bucket{{{SELECTED}}}[1m])))) * 1000"
    )


def test_llm_tokens_are_a_summed_rate_and_waiting_sequences_a_summed_gauge() -> None:
    queries = chat_queries()
    assert queries["outputTokensPerSecond"] == (
        f"sum(rate(vllm:generation_tokens_total{{{SELECTED}}}[1m]))"
    )
    assert queries["waitingSequences"] == f"sum(vllm:num_requests_waiting{{{SELECTED}}})"


def test_the_classic_queries_keep_their_families() -> None:
    queries = chat_queries()
    assert queries["queueDepth"] == f"sum(nv_inference_pending_request_count{{{SELECTED}}})"
    assert queries["gpuUtilization"] == (
        'avg(nv_gpu_utilization{namespace="chat",pod=~"triton-0|triton-1"}) * 100'
    )


# A double-quoted PromQL string: Go's escapes, which JSON's decoder reads for these names.
QUOTED = r'"(?:[^"\\]|\\.)*"'


@pytest.mark.parametrize(
    "name", ['say"hi', "back\\slash", 'both\\"', "dot.ted", "a|b", "star*", "tiny_llm", "ünï-code"]
)
def test_a_model_name_is_matched_literally_whatever_it_holds(name: str) -> None:
    query = prometheus.queries(namespace="chat", pods=["triton-0"], models=[name], window="1m")
    selector = query["queueDepth"]
    matched = re.fullmatch(
        rf'sum\(nv_inference_pending_request_count\{{namespace="chat",pod=~{QUOTED},'
        rf"model=~({QUOTED})\}}\)",
        selector,
    )
    assert matched is not None, selector
    regex = json.loads(matched.group(1))
    assert re.fullmatch(regex, name)
    assert not re.fullmatch(regex, name + "x")
    if "." in name:
        assert not re.fullmatch(regex, name.replace(".", "X"))
