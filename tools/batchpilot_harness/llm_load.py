"""Streaming LLM requests against Triton over gRPC, as a chat client sends them.

Each request is one call of Triton's bidirectional stream with `stream: true`: the server sends a
response per chunk of new tokens and an empty final one. A `Completion` records what the client
saw: when the first token arrived (TTFT), how many tokens came, whether it failed. Client-side
gaps between tokens are not reported: tokens reach a client in bunches, so inter-token latency is
read from the engine's own metrics.

Load is bounded: an open loop sends at a fixed rate for at most a duration and a count, and waits
at most a timeout for the answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton_grpc
from tritonclient.grpc import InferInput, InferRequestedOutput

from batchpilot_harness.llm_models import LLM_MODEL

_FINAL = "triton_final_response"


@dataclass(frozen=True, kw_only=True)
class Completion:
    sent_at: float
    """time.monotonic() when the request was sent."""
    first_token_at: float | None
    last_token_at: float | None
    finished_at: float
    tokens: int
    error: str | None = None

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def mean_inter_token_seconds(self) -> float | None:
        """The decode time per token after the first: robust to tokens arriving in bunches."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.tokens - 1)

    @property
    def ok(self) -> bool:
        return self.error is None


def prompt(length: int, *, seed: int = 0) -> bytes:
    """`length` bytes of lowercase text: `length` prompt tokens for the test model."""
    return bytes(97 + (seed * 7 + index * 13) % 26 for index in range(length))


def _request(text: bytes, *, max_tokens: int, request_id: str) -> dict[str, Any]:
    inputs = [
        InferInput("text_input", [1], "BYTES"),
        InferInput("stream", [1], "BOOL"),
        InferInput("sampling_parameters", [1], "BYTES"),
    ]
    inputs[0].set_data_from_numpy(np.array([text], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True]))
    sampling = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True}
    inputs[2].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    return {
        "model_name": LLM_MODEL,
        "inputs": inputs,
        "outputs": [InferRequestedOutput("text_output")],
        "request_id": request_id,
        "enable_empty_final_response": True,
    }


async def complete(
    client: triton_grpc.InferenceServerClient,
    text: bytes,
    *,
    max_tokens: int,
    request_id: str = "",
    within: float = 120.0,
) -> Completion:
    """Send one streaming request and read it to its final response."""
    request = _request(text, max_tokens=max_tokens, request_id=request_id)

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield request

    sent_at = time.monotonic()
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens = 0
    error: str | None = None
    try:
        async with asyncio.timeout(within):
            async for result, failure in client.stream_infer(requests()):
                if failure is not None:
                    error = str(failure)
                    break
                output = result.as_numpy("text_output")
                if output is not None and output.size:
                    chunk = len(bytes(output.reshape(-1)[0]).split())
                    if chunk:
                        last_token_at = time.monotonic()
                        if first_token_at is None:
                            first_token_at = last_token_at
                    tokens += chunk
                if result.get_response().parameters[_FINAL].bool_param:
                    break
    except TimeoutError:
        error = f"no final response within {within:g}s"
    except Exception as failure:  # a broken stream is a failed request, not a crash
        error = f"{type(failure).__name__}: {failure}"
    if error is None and tokens < max_tokens:
        error = f"the stream ended after {tokens} of {max_tokens} tokens"
    return Completion(
        sent_at=sent_at,
        first_token_at=first_token_at,
        last_token_at=last_token_at,
        finished_at=time.monotonic(),
        tokens=tokens,
        error=error,
    )


async def open_loop(
    grpc_address: str,
    *,
    rate: float,
    seconds: float,
    prompt_tokens: int,
    output_tokens: int,
    max_requests: int = 10_000,
    within: float = 120.0,
    stop: asyncio.Event | None = None,
    on_completion: Callable[[Completion], None] | None = None,
) -> list[Completion]:
    """Send streaming requests at `rate` per second for `seconds` (at most `max_requests`, and
    none after `stop` is set) and wait for all of them; `on_completion` sees each as it ends."""
    async with triton_grpc.InferenceServerClient(grpc_address) as client:
        tasks: list[asyncio.Task[Completion]] = []
        started = time.monotonic()
        count = min(max_requests, max(1, int(rate * seconds)))
        for index in range(count):
            await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
            if stop is not None and stop.is_set():
                break
            task = asyncio.create_task(
                complete(
                    client,
                    prompt(prompt_tokens, seed=index),
                    max_tokens=output_tokens,
                    request_id=str(index),
                    within=within,
                )
            )
            if on_completion is not None:
                task.add_done_callback(lambda done: on_completion(done.result()))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
