"""Builders for the sidecar's unit tests: a collector over a scripted Triton, its HTTP app on a
loopback port, and a fake clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_harness import local_triton
from batchpilot_sidecar import collecting, gpus, llm_recommending, recommending, serving, steptimes
from fake_nvml import FakeGpu, FakeNvml
from fake_triton import FakeModel, FakeTriton

TRUTH = steptimes.StepTimeModel(t0_ms=4.0, c_ms=0.35, alpha=0.7)
FIT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_TRUTH = steptimes.StepTimeModel(t0_ms=3.0, c_ms=0.4, alpha=0.8)
RUNNING_COUNTS = (1, 2, 4, 8, 16)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def no_gpu() -> gpus.GpuMonitor:
    def missing() -> object:
        raise ModuleNotFoundError("No module named 'pynvml'")

    return gpus.GpuMonitor(gpus.NvmlReader(load=missing))


def one_gpu(gpu: FakeGpu | None = None) -> gpus.GpuMonitor:
    library = FakeNvml(gpu or FakeGpu())
    return gpus.GpuMonitor(gpus.NvmlReader(load=lambda: library))


def make_collector(
    triton: FakeTriton,
    clock: Clock,
    *,
    monitor: gpus.GpuMonitor | None = None,
    models: tuple[str, ...] = (),
    model_repository: Path | None = None,
    **settings: float,
) -> collecting.Collector:
    return collecting.Collector(
        triton,
        monitor or no_gpu(),
        models=models,
        settings=collecting.Settings(**settings),  # type: ignore[arg-type]
        clock=clock,
        wall_clock=lambda: 1_795_000_000.0 + clock.now,
        model_repository=model_repository,
    )


async def tick(collector: collecting.Collector, clock: Clock, seconds: float = 1.0) -> None:
    clock.now += seconds
    await collector.collect()


async def fitted(
    model: FakeModel, collector: collecting.Collector, clock: Clock, *, requests: int = 200
) -> None:
    """Executions of every size in FIT_SIZES, then a steady second of `requests` batches of 4,
    so that the model has a fit and an arrival rate."""
    await collector.collect()
    for size in FIT_SIZES:
        model.run(batch_size=size, executions=10, step_ms=TRUTH.ms(size), items_per_request=size)
        await tick(collector, clock)
    model.run(batch_size=4, executions=requests // 4, step_ms=TRUTH.ms(4), queue_ms=3.0)
    await tick(collector, clock, 5.0)


async def decoded(
    model: FakeModel,
    collector: collecting.Collector,
    clock: Clock,
    *,
    running_counts: tuple[int, ...] = RUNNING_COUNTS,
    prompt_tokens: int = 256,
) -> None:
    """An LLM engine that ran each of `running_counts` sequences for two intervals at
    DECODE_TRUTH's step time, then took 10 prompts of `prompt_tokens`."""
    engine = model.engine
    assert engine is not None, "the model needs a FakeEngine"
    await collector.collect()
    for running in running_counts:
        step_ms = DECODE_TRUTH.ms(running)
        for _ in range(2):
            # A 1-s interval: each sequence gets a token every step.
            tokens = round(running * 1000 / step_ms)
            engine.decode(running=running, tokens=tokens, step_ms=step_ms)
            await tick(collector, clock)
    engine.prompts(count=10, tokens_each=prompt_tokens, ttft_ms=40.0)
    await tick(collector, clock, 5.0)


@asynccontextmanager
async def serving_app(
    collector: collecting.Collector,
    default_objective: recommending.Objective | None = None,
    default_llm_objective: llm_recommending.LlmObjective | None = None,
) -> AsyncIterator[str]:
    """The sidecar's app on a loopback port; yields its base URL."""
    runner = web.AppRunner(
        serving.application(
            collector,
            default_objective=default_objective,
            default_llm_objective=default_llm_objective,
        ),
        access_log=None,
    )
    await runner.setup()
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page's samples by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
