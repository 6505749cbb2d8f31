"""LLM profiles against a real vLLM engine behind Triton: a switch under streaming load, the
engine then running the new settings, and settings refused before any reload.

One server for the module (an engine takes about 4 GiB and 30 s to start), built from the vLLM
environment of `batchpilot_harness.llm_env` (built on first use, about 3 minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc.aio as triton_grpc

from batchpilot import running, telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, engines, overrides, rollouts
from batchpilot.policy import rendering
from batchpilot.signals import sources
from batchpilot_harness import llm_load, llm_models, local_sidecar, local_triton, procfs
from batchpilot_sidecar import decodesteps, llm_recommending
from batchpilot_triton import engine_metrics, modelconfigs, repositories, scraping, servers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = llm_models.LLM_MODEL
INTERACTIVE = specs.Profile.model_validate(
    {"llm": {"maxNumSeqs": 2, "maxNumBatchedTokens": 256, "chunkedPrefill": True}}
)


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_triton.LocalTriton]:
    directory = tmp_path_factory.mktemp("llm")
    repository = llm_models.write_repository(directory)
    with llm_models.server(repository, run_directory=directory / "run") as server:
        yield server


def repository_of(server: local_triton.LocalTriton) -> engines.ModelRepository:
    return engines.ModelRepository(server.model_repository)


@contextlib.contextmanager
def llm_sidecar(
    server: local_triton.LocalTriton, tmp_path: Path, *, rate_window: float
) -> Iterator[local_sidecar.LocalSidecar]:
    """The sidecar, reading every 0.5 s, with the server's model repository as a Pod's sidecar
    reads it (the engine's max_num_seqs is in its model.json), once it has a first reading (on a
    busy machine it answers before it has read Triton twice, and a load started then is partly
    left out)."""
    with local_sidecar.running(
        server,
        *("--interval", "0.5", "--rate-window", f"{rate_window:g}"),
        *("--model-repository", str(server.model_repository)),
        command=("-m", "batchpilot", "sidecar"),
        log=tmp_path / "sidecar.log",
    ) as sidecar:
        sidecar_report(
            sidecar.url, until=lambda report: (report.get("window") or {}).get("seconds", 0) > 0
        )
        yield sidecar


def sidecar_report(
    url: str, *, until: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> dict[str, Any]:
    """The sidecar's report on the model once `until` holds of it, or the last one after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/status", timeout=5) as response:
            report: dict[str, Any] | None = json.loads(response.read())["models"].get(MODEL)
        if report is not None and (until(report) or time.monotonic() > deadline):
            return report
        assert time.monotonic() < deadline, "the sidecar never reported the model"
        time.sleep(0.25)


def metrics_snapshot(server: local_triton.LocalTriton) -> scraping.Snapshot:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        return scraping.parse(response.read().decode(), taken_at=time.monotonic())


async def burst_in_the_engine(
    server: local_triton.LocalTriton, *, size: int, output_tokens: int
) -> decodesteps.Sample:
    """Send `size` requests at once and read what the engine counted of them, as the sidecar's
    fit reads a span (`decodesteps.sample`): the sequences its steps ran on average (tokens
    generated per step) and its mean step (the mean gap between tokens). Both are measured on
    the engine's clock, so they hold however late its statistics reach Triton on a loaded
    machine; the burst ends once they all have."""
    before = await asyncio.to_thread(metrics_snapshot, server)
    burst = await at_once(server, size=size, output_tokens=output_tokens)
    assert all(completion.ok for completion in burst), [c.error for c in burst if not c.ok][:3]
    deadline = time.monotonic() + 30
    while True:
        after = await asyncio.to_thread(metrics_snapshot, server)
        engine = scraping.rates(before, after)[MODEL].engine
        assert engine is not None
        if engine.generation_tokens >= size * output_tokens:
            break
        assert time.monotonic() < deadline, "the engine's statistics of the burst never came"
        await asyncio.sleep(0.2)
    found = decodesteps.sample(engine, seconds=after.taken_at - before.taken_at)
    assert found is not None, "the engine measured no gap between tokens"
    assert engine.iteration_tokens.count > 0, "the engine does not count its steps"
    return found


async def at_once(
    server: local_triton.LocalTriton, *, size: int, output_tokens: int
) -> list[llm_load.Completion]:
    """`size` streaming requests sent together on one channel, read to their ends."""
    async with triton_grpc.InferenceServerClient(server.grpc_address) as client:
        return list(
            await asyncio.gather(
                *(
                    llm_load.complete(
                        client,
                        llm_load.prompt(32, seed=index),
                        max_tokens=output_tokens,
                        request_id=f"burst-{size}-{index}",
                    )
                    for index in range(size)
                )
            )
        )


async def room_for(server: local_triton.LocalTriton, *, sequences: int) -> int:
    """Make the engine run up to `sequences` at once, reloading only if it was loaded with fewer
    (the repository's arguments allow 16); the most it runs then."""
    async with servers.TritonServer(server.http_url, load_timeout=300) as triton:
        applied = engines.applied_arguments(await triton.model_config(MODEL))
        # The engine's model.json: a profile's arguments over the repository's.
        base = repositories.read_repository_arguments(server.model_repository, MODEL)
        loaded = {**base.arguments, **(applied or {})}
        if loaded.get("max_num_seqs", 0) >= sequences:
            return int(loaded["max_num_seqs"])
        roomy = specs.Profile.model_validate(
            {"llm": {"maxNumSeqs": sequences, "maxNumBatchedTokens": 2048}}
        )
        await actuators.apply_profile(
            triton,
            MODEL,
            rendering.render(roomy),
            profile="roomy",
            engine_arguments=repository_of(server),
            verify_timeout=300,
        )
    return sequences


def stubs(server: local_triton.LocalTriton) -> set[int]:
    """The server's Python-backend stubs: a reload replaces them."""
    return procfs.children(server.pid)


def test_the_repository_model_json_is_what_the_engine_was_started_with(
    llm_server: local_triton.LocalTriton,
) -> None:
    base = repositories.read_repository_arguments(llm_server.model_repository, MODEL)
    assert base.version == "1"
    assert base.arguments == json.loads(
        (Path(llm_server.model_repository) / MODEL / "1" / "model.json").read_text()
    )
    assert base.arguments["model"] == str(llm_models.WEIGHTS_CONFIG)


def test_no_thread_of_the_engine_is_pinned_to_a_core(
    llm_server: local_triton.LocalTriton,
) -> None:
    """By default a CPU engine pins its OpenMP threads to cores, and everything beside it on
    these two cores stalled for up to 1.5 s, Tritons' Python-backend stubs too
    (`llm_models.ENGINE_THREAD_BINDING`)."""
    everywhere = os.sched_getaffinity(0)
    threads = {}
    for pid in procfs.group_members(llm_server.pid):
        with contextlib.suppress(OSError):  # a thread or process that ended meanwhile
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    name = (task / "comm").read_text().strip()
                    threads[f"{pid}/{task.name} ({name})"] = os.sched_getaffinity(int(task.name))
    assert len(threads) > 10, threads  # the server, its stub, the engine core and its worker
    pinned = {thread: sorted(cpus) for thread, cpus in threads.items() if cpus != everywhere}
    assert not pinned, f"pinned to fewer than the CPUs {sorted(everywhere)}: {pinned}"


def test_the_sidecar_s_ttft_inter_token_latency_and_tokens_agree_with_the_client_s(
    llm_server: local_triton.LocalTriton, tmp_path: Path
) -> None:
    with llm_sidecar(llm_server, tmp_path, rate_window=60) as sidecar:
        before = metrics_snapshot(llm_server)
        completions = asyncio.run(
            llm_load.open_loop(
                llm_server.grpc_address, rate=6, seconds=15, prompt_tokens=64, output_tokens=32
            )
        )
        client_tokens = sum(completion.tokens for completion in completions)

        def counted_all(report: dict[str, Any]) -> bool:
            llm = report.get("llm") or {}
            engine_tokens = llm.get("outputTokensPerSecond", 0) * report["window"]["seconds"]
            return bool(
                llm.get("firstTokens", 0) >= len(completions)
                and engine_tokens >= client_tokens - 0.5
            )

        # A last reading after it: the engine's statistics reach Triton a step late.
        report = sidecar_report(sidecar.url, until=counted_all)
        after = metrics_snapshot(llm_server)
    assert all(completion.ok for completion in completions)
    llm = report["llm"]
    engine = scraping.rates(before, after)[MODEL].engine
    assert engine is not None
    client_ttft_ms = [1000 * c.ttft_seconds for c in completions if c.ttft_seconds is not None]
    client_ttft_p50 = llm_load.percentile(client_ttft_ms, 0.5)
    engine_tokens = llm["outputTokensPerSecond"] * report["window"]["seconds"]
    client_seconds = sum(c.finished_at - c.sent_at for c in completions)

    def engine_ms(histogram: engine_metrics.Histogram, q: float) -> float:
        found = histogram.quantile(q)
        assert found is not None
        return 1000 * found

    print(
        f"\nTTFT ms p50/p95: sidecar {llm['ttftP50Ms']} / {llm['ttftP95Ms']}, client"
        f" {client_ttft_p50:.1f} / {llm_load.percentile(client_ttft_ms, 0.95):.1f}"
        f"\ninter-token ms p50/p95: sidecar {llm['interTokenP50Ms']} / {llm['interTokenP95Ms']}"
        f"\noutput tokens: sidecar {engine_tokens:.0f}, client {client_tokens}; seconds between"
        f" tokens in the engine {engine.inter_token.total:.1f}, requests open in the client"
        f" {client_seconds:.1f}"
    )
    # Every request and token the client saw, the sidecar counted.
    assert llm["firstTokens"] == len(completions)
    assert engine_tokens == pytest.approx(client_tokens, rel=0.02)
    # Its quantiles are those of the engine's own histograms over the load: the right families,
    # models, window and units.
    for field, histogram in (
        ("ttft", engine.time_to_first_token),
        ("interToken", engine.inter_token),
    ):
        for q, name in ((0.5, "P50Ms"), (0.95, "P95Ms")):
            assert llm[field + name] == pytest.approx(engine_ms(histogram, q), rel=0.05, abs=0.01)
    # And the engine's times lie inside the client's, whatever a loaded machine adds on the
    # client's side: a request's first token within the time the client waited for it, its gaps
    # between tokens within the time the client held the request open.
    assert llm["ttftP50Ms"] <= 1.1 * client_ttft_p50 + 5
    assert 0 < engine.inter_token.total <= client_seconds


def model_status(url: str, query: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/status?{query}", timeout=5) as response:
        report: dict[str, Any] = json.loads(response.read())["models"][MODEL]
    return report


async def fitted_after(url: str, query: str, loaded_until: float) -> dict[str, Any]:
    """The sidecar's report once its step-time fit has taken in every sample of a load that
    ended at `loaded_until`: two 2-s spans after it the last sample has been taken, and the fit
    is up to date once it has been refitted with it (every few seconds)."""
    await asyncio.sleep(max(0.0, loaded_until + 2 * decodesteps.SAMPLE_SECONDS - time.monotonic()))
    deadline = time.monotonic() + 30
    while True:
        report = await asyncio.to_thread(model_status, url, query)
        fit = report["llm"]["stepTime"]
        if fit["upToDate"]:
            return report
        assert time.monotonic() < deadline, f"the fit never took in the load: {fit}"
        await asyncio.sleep(0.5)


FIT_OUTPUT_TOKENS = 256
"""Tokens each request of the fit's bursts decodes: a burst decodes for a second or more."""
FIT_SIZES = (1, 16, 4, 2, 8) * 2
"""The fit's load: bursts of each size, every size twice and interleaved, so that a machine
whose load drifts slows every size alike."""
FIT_HOLD_SECONDS = 3.0
"""How long the fit's load holds a size, sending the next burst once one has ended."""
BURST = 8
"""Requests of the burst the fit and the switch are judged by."""
BURST_OUTPUT_TOKENS = 448
"""Tokens each request of the switch's bursts decodes (with its 32 prompt tokens, within the
test model's max_model_len of 512): seconds of steps, against which a loaded client's spread in
sending the burst is small."""
AFTER_SWITCH_OUTPUT_TOKENS = 128
"""Tokens each request of the burst after the switch decodes. No step of an engine held to
2 sequences runs more than 2 whatever the burst's length; one that ignored the limit would run
the 8 together for about a second of steps, still long against that spread. At 2 sequences a
step, 448 tokens each took 12 s."""


async def test_the_sidecar_fits_the_engine_s_step_time_and_recommends_its_limits(
    llm_server: local_triton.LocalTriton, tmp_path: Path
) -> None:
    objectives = "ttftP95Ms=500&itlP95Ms=20"
    limit = await room_for(llm_server, sequences=16)
    # The rate window outlasts the wait for the fit, so the prompts the recommendation sizes
    # maxNumBatchedTokens by are still in it when the report is read.
    with llm_sidecar(llm_server, tmp_path, rate_window=30) as sidecar:
        # Bursts of 1 to 16 requests sent at once: the engine runs each burst's sequences
        # together for all of their steps, however slowly a loaded machine runs this client.
        # Those of 8 are measured from the engine's own counts.
        at_burst: list[decodesteps.Sample] = []
        for size in FIT_SIZES:
            held_until = time.monotonic() + FIT_HOLD_SECONDS
            while time.monotonic() < held_until:
                if size == BURST:
                    at_burst.append(
                        await burst_in_the_engine(
                            llm_server, size=size, output_tokens=FIT_OUTPUT_TOKENS
                        )
                    )
                    continue
                burst = await at_once(llm_server, size=size, output_tokens=FIT_OUTPUT_TOKENS)
                assert all(completion.ok for completion in burst)
        loaded_until = time.monotonic()
        report = await fitted_after(sidecar.url, objectives, loaded_until)
    tokens_at_burst = sum(sample.tokens for sample in at_burst)
    measured = decodesteps.Sample(
        running=sum(sample.running * sample.tokens for sample in at_burst) / tokens_at_burst,
        tokens=tokens_at_burst,
        mean_ms=sum(sample.mean_ms * sample.tokens for sample in at_burst) / tokens_at_burst,
    )
    llm = report["llm"]
    fit, recommendation = llm["stepTime"], llm["recommendation"]
    print(f"\nLLM step-time fit: {json.dumps(fit)}\nrecommendation: {json.dumps(recommendation)}")
    assert fit["status"] == "fitted", fit["reason"]
    fitted_ms = fit["t0Ms"] + fit["cMs"] * measured.running ** fit["alpha"]
    print(
        f"bursts of {BURST}: {measured.running:.2f} sequences a step in the engine, fitted step"
        f" {fitted_ms:.2f} ms, measured mean step {measured.mean_ms:.2f} ms"
        f" (inter-token p50 {llm['interTokenP50Ms']} ms)"
    )
    # The fit spans the measured bursts, so the comparison is an interpolation between running
    # counts it saw on both sides, and it predicts the engine's step there: 6% to 31% over it
    # in ten runs beside a loaded machine (its 2-s spans catch bursts starting and ending, the
    # bursts' own counts do not), so the test allows 40%.
    assert min(fit["batchSizes"]) < measured.running < max(fit["batchSizes"])
    assert fitted_ms == pytest.approx(measured.mean_ms, rel=0.4)
    assert recommendation["status"] == "ok"
    seqs = recommendation["maxNumSeqs"]["value"]
    tokens = recommendation["maxNumBatchedTokens"]["value"]
    # The sidecar knows the engine's limit, so no running count it fitted exceeds it however the
    # engine's statistics bunched; the recommendation goes no further than twice the most it
    # fitted, so never beyond twice the limit.
    assert report["config"]["maxNumSeqs"] == limit
    assert max(fit["batchSizes"]) <= limit
    assert 1 <= seqs <= llm_recommending.EXTRAPOLATION_LIMIT * max(fit["batchSizes"])
    assert tokens >= seqs
    assert recommendation["maxNumSeqs"]["meetsObjective"]


async def test_a_switch_under_streaming_load_fails_no_request_and_the_engine_runs_it(
    llm_server: local_triton.LocalTriton,
) -> None:
    await room_for(llm_server, sequences=BURST)
    before = await burst_in_the_engine(llm_server, size=BURST, output_tokens=BURST_OUTPUT_TOKENS)
    async with servers.TritonServer(
        llm_server.http_url, metrics_url=llm_server.metrics_url
    ) as server:
        stop = asyncio.Event()
        load = asyncio.create_task(
            llm_load.open_loop(
                llm_server.grpc_address,
                rate=4,
                seconds=150,
                prompt_tokens=64,
                output_tokens=24,
                stop=stop,
            )
        )
        await asyncio.sleep(3)
        applied = await actuators.apply_profile(
            server,
            MODEL,
            rendering.render(INTERACTIVE),
            profile="interactive",
            engine_arguments=repository_of(llm_server),
            verify_timeout=180,
        )
        await asyncio.sleep(3)
        stop.set()
        completions = await load
        served = await server.model_config(MODEL)
        again = await actuators.apply_profile(
            server,
            MODEL,
            rendering.render(INTERACTIVE),
            profile="interactive",
            engine_arguments=repository_of(llm_server),
        )

    assert applied.reloaded
    failures = [completion.error for completion in completions if not completion.ok]
    assert not failures, f"{len(failures)} of {len(completions)} streams failed: {failures[:3]}"
    assert len(completions) >= 20
    assert modelconfigs.applied_profile(served) == "interactive"
    assert engines.applied_arguments(served) == {
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
        "enable_chunked_prefill": True,
    }
    assert not again.reloaded
    # The engine runs the new arguments: of a burst of 8 sent at once, its steps ran more than
    # the new settings allow before, and 2 at most after.
    after = await burst_in_the_engine(
        llm_server, size=BURST, output_tokens=AFTER_SWITCH_OUTPUT_TOKENS
    )
    print(
        f"\nswitch under streaming load: applied in {applied.seconds:.1f}s, "
        f"{len(completions)} streams, {len(failures)} failed; in a burst of {BURST}, the engine's"
        f" steps ran {before.running:.2f} sequences on average before, {after.running:.2f} after"
    )
    assert before.running > 3
    assert after.running <= 2


async def test_engine_settings_the_model_cannot_take_are_refused_before_any_reload(
    llm_server: local_triton.LocalTriton,
) -> None:
    unchunked = specs.Profile.model_validate(
        {"llm": {"chunkedPrefill": False, "maxNumBatchedTokens": 256}}
    )
    batching_only = specs.Profile.model_validate({"maxQueueDelayMicroseconds": 5000})
    running = stubs(llm_server)
    async with servers.TritonServer(llm_server.http_url) as server:
        served = await server.model_config(MODEL)
        with pytest.raises(
            overrides.ProfileRefused,
            match=r"256 is below model 'tiny_llm'.s max_model_len 512",
        ):
            await actuators.apply_profile(
                server,
                MODEL,
                rendering.render(unchunked),
                profile="unchunked",
                engine_arguments=repository_of(llm_server),
            )
        with pytest.raises(overrides.ProfileRefused, match="needs an llm section"):
            await actuators.apply_profile(
                server,
                MODEL,
                rendering.render(batching_only),
                profile="batching-only",
                engine_arguments=repository_of(llm_server),
            )
        assert await server.model_config(MODEL) == served
    # No stub started since: nothing was reloaded (an earlier test's stub may still be exiting).
    assert running
    assert stubs(llm_server) <= running


async def test_the_runner_applies_a_policy_s_llm_profile_with_the_repository_it_reads(
    llm_server: local_triton.LocalTriton,
) -> None:
    spec = specs.parse_spec(
        {
            "target": {"selector": {"matchLabels": {"app": "triton"}}, "models": [MODEL]},
            "profiles": {
                "interactive": {"llm": {"maxNumSeqs": 2, "maxNumBatchedTokens": 256}},
                "bulk": {"llm": {"maxNumSeqs": 8, "maxNumBatchedTokens": 1024}},
            },
            "defaultProfile": "bulk",
            "minDwellSeconds": 0,
        }
    )

    async def tick(repository: Path | None) -> rollouts.Outcome:
        triton = servers.TritonServer(llm_server.http_url, metrics_url=llm_server.metrics_url)
        runner = running.Runner(
            name="llm",
            spec=spec,
            triton_servers=[triton],
            source=sources.TritonMetricsSource([triton], models=[MODEL]),
            metrics=telemetry.controller_metrics(),
            model_repository=repository,
        )
        try:
            (outcome,) = (await runner.tick()).outcomes
        finally:
            await runner.close()
        return outcome

    refused = await tick(None)
    assert (refused.state, refused.error) == ("Failed", "refused")
    assert "needs its repository's model.json" in refused.message
    applied = await tick(llm_server.model_repository)
    assert (applied.state, applied.profile, applied.reloads) == ("Updated", "bulk", 1)
    async with servers.TritonServer(llm_server.http_url) as triton:
        served = await triton.model_config(MODEL)
    assert engines.applied_arguments(served) == {"max_num_seqs": 8, "max_num_batched_tokens": 1024}
