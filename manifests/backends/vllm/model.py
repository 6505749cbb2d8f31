"""A Python-based Triton backend named `vllm`: batchpilot's stand-in for NVIDIA's vLLM backend.

NVIDIA's backend (github.com/triton-inference-server/vllm_backend) is not on PyPI, so the test
world serves its LLM with this one, which keeps the parts batchpilot touches the same:

- the engine arguments are read from `model.json` in the model's version directory, and nowhere
  else, so a profile changes them exactly as it would for a user's model: a load request that
  overrides `model.json`;
- the model is decoupled: inputs `text_input`, `stream`, `sampling_parameters` (JSON), output
  `text_output`, one response per chunk of new tokens while streaming;
- with the config parameter `REPORT_CUSTOM_METRICS` the engine's own statistics are exported on
  Triton's metrics endpoint under vLLM's names (`vllm:time_to_first_token_seconds`,
  `vllm:inter_token_latency_seconds`, `vllm:num_requests_running`, ...), measured inside the
  engine, where a client cannot see them (streamed tokens reach a client in bunches).

Two differences, both because the test model has no tokenizer (`skip_tokenizer_init`): the
prompt's UTF-8 bytes are its token ids (offset past the special tokens), and `text_output` is the
generated token ids as decimal text.

It runs in the Python stub's interpreter, the vLLM environment's (`batchpilot_harness.llm_env`).
"""

from __future__ import annotations

import asyncio
import json
import locale
import os
import threading
import uuid
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

# Before vLLM is imported: the stub's interpreter starts in the C locale, in which torch's
# compiler cannot read its own (UTF-8) templates.
locale.setlocale(locale.LC_ALL, "C.UTF-8")

ENGINE_ARGUMENTS_FILE = "model.json"
_TOKEN_OFFSET = 3
"""Prompt bytes become token ids above the special tokens (0-2) of the test model's vocabulary."""

# Finer than vLLM's own buckets at the low end: a CPU engine's inter-token latency is a few ms.
_TTFT_BUCKETS = [
    *(0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8),
    *(1.0, 1.5, 2.0, 3.0, 5.0, 10.0),
]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0]
# NVIDIA's backend's buckets for the tokens of an engine step.
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class _EngineMetrics:
    """vLLM's statistics as Triton custom metrics, labelled like NVIDIA's backend does."""

    def __init__(self, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        # A family must outlive its metrics: keep every one.
        self._families: list[Any] = []

        def family(name: str, description: str, kind: Any) -> Any:
            self._families.append(pb_utils.MetricFamily(name, description, kind))
            return self._families[-1]

        kinds = pb_utils.MetricFamily
        self.ttft = family(
            name="vllm:time_to_first_token_seconds",
            description="Time from a request's arrival in the engine to its first token.",
            kind=kinds.HISTOGRAM,
        ).Metric(labels=labels, buckets=_TTFT_BUCKETS)
        self.inter_token = family(
            name="vllm:inter_token_latency_seconds",
            description="Time between two consecutive tokens of one request, in the engine.",
            kind=kinds.HISTOGRAM,
        ).Metric(labels=labels, buckets=_ITL_BUCKETS)
        self.iteration_tokens = family(
            name="vllm:iteration_tokens_total",
            description="Tokens (prompt and generated) of each engine step.",
            kind=kinds.HISTOGRAM,
        ).Metric(labels=labels, buckets=_ITERATION_TOKEN_BUCKETS)
        self.generation_tokens = family(
            name="vllm:generation_tokens_total",
            description="Output tokens generated.",
            kind=kinds.COUNTER,
        ).Metric(labels=labels)
        self.prompt_tokens = family(
            name="vllm:prompt_tokens_total",
            description="Prompt tokens processed.",
            kind=kinds.COUNTER,
        ).Metric(labels=labels)
        self.running = family(
            name="vllm:num_requests_running",
            description="Requests the engine is running (prefilling or decoding).",
            kind=kinds.GAUGE,
        ).Metric(labels=labels)
        self.waiting = family(
            name="vllm:num_requests_waiting",
            description="Requests waiting for the engine to admit them.",
            kind=kinds.GAUGE,
        ).Metric(labels=labels)
        self.kv_cache_usage = family(
            name="vllm:kv_cache_usage_perc",
            description="Fraction of the KV cache in use (0..1).",
            kind=kinds.GAUGE,
        ).Metric(labels=labels)

    def stat_logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        metrics = self

        class TritonStatLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                try:
                    self._record(scheduler_stats, iteration_stats)
                except Exception as error:  # metrics must never stop the engine
                    pb_utils.Logger.log_warn(f"vLLM statistics not exported: {error}")

            def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
                if scheduler_stats is not None:
                    metrics.running.set(scheduler_stats.num_running_reqs)
                    metrics.waiting.set(scheduler_stats.num_waiting_reqs)
                    metrics.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
                if iteration_stats is not None:
                    metrics.iteration_tokens.observe(
                        iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
                    )
                    for seconds in iteration_stats.time_to_first_tokens_iter:
                        metrics.ttft.observe(seconds)
                    for seconds in iteration_stats.inter_token_latencies_iter:
                        metrics.inter_token.observe(seconds)
                    if iteration_stats.num_generation_tokens:
                        metrics.generation_tokens.increment(iteration_stats.num_generation_tokens)
                    if iteration_stats.num_prompt_tokens:
                        metrics.prompt_tokens.increment(iteration_stats.num_prompt_tokens)

            def log_engine_initialized(self) -> None:
                pass

        return TritonStatLogger


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        config = json.loads(args["model_config"])
        version_directory = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(version_directory, ENGINE_ARGUMENTS_FILE)) as file:
            self.engine_arguments: dict[str, Any] = json.load(file)
        parameters = config.get("parameters") or {}
        report = parameters.get("REPORT_CUSTOM_METRICS", {}).get("string_value", "false")
        stat_loggers = []
        if report.lower() in ("true", "yes", "1"):
            metrics = _EngineMetrics(args["model_name"], args["model_version"])
            stat_loggers.append(metrics.stat_logger_factory())
        self.vocabulary = 1024
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start_engine() -> Any:
            engine_args = AsyncEngineArgs(**self.engine_arguments)
            return AsyncLLM.from_engine_args(engine_args, stat_loggers=stat_loggers or None)

        self.engine = asyncio.run_coroutine_threadsafe(start_engine(), self.loop).result()
        self.vocabulary = int(self.engine.model_config.get_vocab_size())
        pb_utils.Logger.log_info(f"vLLM engine ready with {self.engine_arguments}")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                # Read here: the inputs' memory is not the request's once execute returns.
                inputs = _read_inputs(request)
            except Exception as error:
                _fail(sender, f"bad request: {error}")
                continue
            asyncio.run_coroutine_threadsafe(self._generate(*inputs, sender), self.loop)
        return None

    async def _generate(
        self, prompt: bytes, stream: bool, sampling: dict[str, Any], sender: Any
    ) -> None:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        try:
            kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
            params = SamplingParams(**sampling, output_kind=kind)
            room = self.vocabulary - _TOKEN_OFFSET
            token_ids = [_TOKEN_OFFSET + byte % room for byte in prompt]
            async for output in self.engine.generate(
                {"prompt_token_ids": token_ids}, params, uuid.uuid4().hex
            ):
                tokens = output.outputs[0].token_ids
                if tokens:
                    sender.send(_response(tokens))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:  # the request fails, the model stays up
            _fail(sender, str(error))

    def finalize(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _response(token_ids: Any) -> Any:
    text = " ".join(str(token) for token in token_ids).encode()
    tensor = pb_utils.Tensor("text_output", np.array([text], dtype=np.object_))
    return pb_utils.InferenceResponse(output_tensors=[tensor])


def _read_inputs(request: Any) -> tuple[bytes, bool, dict[str, Any]]:
    text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
    stream = pb_utils.get_input_tensor_by_name(request, "stream")
    sampling = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
    return (
        bytes(text.reshape(-1)[0]),
        bool(stream.as_numpy().reshape(-1)[0]) if stream is not None else False,
        json.loads(bytes(sampling.as_numpy().reshape(-1)[0])) if sampling is not None else {},
    )


def _fail(sender: Any, message: str) -> None:
    sender.send(
        pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )
