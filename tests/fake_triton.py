"""A scripted Triton for the sidecar's unit tests: cumulative counters advanced by hand, served as
Triton's metrics page (its families and labels) and statistics-extension JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from batchpilot_triton import scraping, servers

ENGINE_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)
"""Upper bounds of the fake engine's histogram buckets, in seconds."""


@dataclasses.dataclass
class FakeEngine:
    """An LLM engine's own counts, as Triton's vLLM backend exports them with
    REPORT_CUSTOM_METRICS (histograms with buckets, sums and counts; token counters; gauges),
    advanced by hand."""

    ttft: dict[float, int] = dataclasses.field(default_factory=dict)
    """Cumulative first tokens by upper bound (seconds)."""
    inter_token: dict[float, int] = dataclasses.field(default_factory=dict)
    """Cumulative gaps between tokens by upper bound (seconds)."""
    first_tokens: int = 0
    ttft_seconds: float = 0.0
    gaps: int = 0
    gap_seconds: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    running: float = 0.0
    waiting: float = 0.0
    counts_steps: bool = True
    """Whether it exports `vllm:iteration_tokens_total` (one observation per engine step), as
    NVIDIA's vLLM backend does."""
    steps: float = 0.0
    step_tokens: float = 0.0

    def answer(self, *, requests: int, ttft_s: float, tokens: int, gap_s: float) -> None:
        """`requests` answers of `tokens` tokens each: the first after `ttft_s`, the others
        `gap_s` apart."""
        self._first_tokens(requests, ttft_s)
        self._gaps(requests * (tokens - 1), gap_s)
        self.generation_tokens += requests * tokens

    def decode(self, *, running: float, tokens: int, step_ms: float) -> None:
        """`tokens` tokens after the first of their sequences, `step_ms` apart, with `running`
        sequences running from here on."""
        self.running = running
        self._gaps(tokens, step_ms / 1000)
        self.generation_tokens += tokens
        self.steps += tokens / running
        self.step_tokens += tokens

    def prompts(self, *, count: int, tokens_each: int, ttft_ms: float) -> None:
        """`count` prompts of `tokens_each` tokens, each first token `ttft_ms` after arrival."""
        self._first_tokens(count, ttft_ms / 1000)
        self.prompt_tokens += count * tokens_each
        self.generation_tokens += count

    def _first_tokens(self, count: int, seconds: float) -> None:
        self.first_tokens += count
        self.ttft_seconds += count * seconds
        _observe(self.ttft, count, seconds)

    def _gaps(self, count: int, seconds: float) -> None:
        self.gaps += count
        self.gap_seconds += count * seconds
        _observe(self.inter_token, count, seconds)

    def families(self, labels: str) -> dict[str, list[str]]:
        """The vLLM backend's families, each as its TYPE line and its samples."""
        found: dict[str, list[str]] = {}
        for family, buckets, count, seconds in (
            ("vllm:time_to_first_token_seconds", self.ttft, self.first_tokens, self.ttft_seconds),
            ("vllm:inter_token_latency_seconds", self.inter_token, self.gaps, self.gap_seconds),
        ):
            lines = [
                f"# TYPE {family} histogram",
                f"{family}_count{{{labels}}} {count}",
                f"{family}_sum{{{labels}}} {seconds}",
            ]
            for bound in ENGINE_BOUNDS:
                le = "+Inf" if math.isinf(bound) else f"{bound}"
                lines.append(f'{family}_bucket{{{labels},le="{le}"}} {buckets.get(bound, 0)}')
            found[family] = lines
        if self.counts_steps:
            family = "vllm:iteration_tokens_total"
            found[family] = [
                f"# TYPE {family} histogram",
                f"{family}_count{{{labels}}} {self.steps}",
                f"{family}_sum{{{labels}}} {self.step_tokens}",
                f'{family}_bucket{{{labels},le="+Inf"}} {self.steps}',
            ]
        for family, kind, value in (
            ("vllm:prompt_tokens_total", "counter", self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", self.generation_tokens),
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", self.waiting),
        ):
            found[family] = [f"# TYPE {family} {kind}", f"{family}{{{labels}}} {value}"]
        return found


def _observe(buckets: dict[float, int], count: int, seconds: float) -> None:
    for bound in ENGINE_BOUNDS:
        if seconds <= bound:
            buckets[bound] = buckets.get(bound, 0) + count


@dataclasses.dataclass
class FakeModel:
    name: str
    max_batch_size: int = 128
    queue_delay_us: int = 1000
    memory_per_item_bytes: float | None = None
    succeeded: int = 0
    failed: int = 0
    inferences: int = 0
    executions: int = 0
    request_us: float = 0.0
    queue_us: float = 0.0
    compute_us: float = 0.0
    pending: int = 0
    quantiles_us: dict[float, float] = dataclasses.field(default_factory=dict)
    batch_stats: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """Batch size -> [executions, compute nanoseconds]."""
    engine: FakeEngine | None = None
    """The LLM engine behind the model, for one served by Triton's vLLM backend."""
    engine_arguments: dict[str, Any] | None = None
    """The engine arguments batchpilot applied, as its config parameter carries them."""

    def run(
        self,
        *,
        batch_size: int,
        executions: int,
        step_ms: float,
        queue_ms: float = 1.0,
        items_per_request: int = 1,
    ) -> None:
        """Executions of one batch size, each of `batch_size / items_per_request` requests."""
        requests = executions * batch_size // items_per_request
        self.succeeded += requests
        self.inferences += executions * batch_size
        self.executions += executions
        self.queue_us += requests * queue_ms * 1000
        self.compute_us += requests * step_ms * 1000  # every request accrues its batch's
        self.request_us += requests * (queue_ms + step_ms) * 1000
        count, nanoseconds = self.batch_stats.get(batch_size, [0, 0])
        self.batch_stats[batch_size] = [
            count + executions,
            nanoseconds + round(executions * step_ms * 1e6),
        ]

    def reload(self) -> None:
        """A reload starts the statistics afresh (the metrics too, as new series)."""
        self.batch_stats = {}


class FakeTriton:
    url = "http://triton.test:8000"
    metrics_url = "http://triton.test:8002/metrics"

    def __init__(self, *models: FakeModel) -> None:
        self.models = {model.name: model for model in models}
        self.down = False
        self.summaries = True
        self.config_reads = 0

    def add(self, model: FakeModel) -> FakeModel:
        self.models[model.name] = model
        return model

    def _check(self, what: str) -> None:
        if self.down:
            raise servers.Unreachable(self.url, f"{what}: Connection refused")

    async def metrics_snapshot(self, clock: Callable[[], float]) -> scraping.Snapshot:
        return scraping.parse(await self.metrics_text(), taken_at=clock())

    async def metrics_text(self) -> str:
        self._check("metrics")
        families: dict[str, list[str]] = {}

        def add(family: str, kind: str, labels: str, value: float) -> None:
            lines = families.setdefault(family, [f"# TYPE {family} {kind}"])
            lines.append(f"{family}{{{labels}}} {value}")

        for model in self.models.values():
            labels = f'model="{model.name}",version="1"'
            add("nv_inference_request_success", "counter", labels, model.succeeded)
            add(
                "nv_inference_request_failure",
                "counter",
                f'{labels},reason="BACKEND"',
                model.failed,
            )
            add("nv_inference_count", "counter", labels, model.inferences)
            add("nv_inference_exec_count", "counter", labels, model.executions)
            add("nv_inference_request_duration_us", "counter", labels, model.request_us)
            add("nv_inference_queue_duration_us", "counter", labels, model.queue_us)
            add("nv_inference_compute_infer_duration_us", "counter", labels, model.compute_us)
            add("nv_inference_pending_request_count", "gauge", labels, model.pending)
            if model.engine is not None:
                for family, lines in model.engine.families(labels).items():
                    families.setdefault(family, lines[:1]).extend(lines[1:])
        if self.summaries:
            family = "nv_inference_request_summary_us"
            lines = families.setdefault(family, [f"# TYPE {family} summary"])
            for model in self.models.values():
                labels = f'model="{model.name}",version="1"'
                lines.append(f"{family}_count{{{labels}}} {model.succeeded}")
                lines.append(f"{family}_sum{{{labels}}} {model.request_us}")
                for quantile in (0.5, 0.9, 0.95, 0.99):
                    value = model.quantiles_us.get(quantile, float("nan"))
                    lines.append(f'{family}{{{labels},quantile="{quantile}"}} {value}')
        return "\n".join(line for lines in families.values() for line in lines) + "\n"

    async def statistics(self, model: str = "") -> list[dict[str, Any]]:
        self._check("statistics")
        return [
            {
                "name": served.name,
                "version": "1",
                "inference_count": served.inferences,
                "execution_count": served.executions,
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": count, "ns": count * 1000},
                        "compute_infer": {"count": count, "ns": nanoseconds},
                        "compute_output": {"count": count, "ns": count * 1000},
                    }
                    for size, (count, nanoseconds) in sorted(served.batch_stats.items())
                ],
            }
            for served in self.models.values()
            if not model or served.name == model
        ]

    async def model_config(self, model: str) -> dict[str, Any]:
        self._check(f"config of {model}")
        self.config_reads += 1
        served = self.models.get(model)
        if served is None:
            raise servers.ModelUnavailable(self.url, f"config of {model}: unknown model")
        config: dict[str, Any] = {
            "name": model,
            "max_batch_size": served.max_batch_size,
            "dynamic_batching": {
                "max_queue_delay_microseconds": served.queue_delay_us,
                "preferred_batch_size": [],
            },
            "parameters": {},
        }
        if served.memory_per_item_bytes is not None:
            config["parameters"]["batchpilot.dev/memory-per-item-bytes"] = {
                "string_value": str(served.memory_per_item_bytes)
            }
        if served.engine is not None:
            config["backend"] = "vllm"
        if served.engine_arguments is not None:
            config["parameters"]["batchpilot.dev/engine-arguments"] = {
                "string_value": json.dumps(served.engine_arguments)
            }
        return config
