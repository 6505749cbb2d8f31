"""LLM profiles against a real vLLM engine behind Triton: a switch under streaming load, the
engine then running the new settings, and settings refused before any reload.

One server for the module (an engine takes about 4 GiB and 30 s to start), built from the vLLM
environment of `batchpilot_harness.llm_env` (built on first use, about 3 minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc.aio as triton_grpc

from batchpilot import running, telemetry
from batchpilot.applying import actuators, engines, overrides, rollouts
from batchpilot.policy import rendering, specs
from batchpilot.signals import sources
from batchpilot_harness import llm_load, llm_models, local_sidecar, local_triton, processes
from batchpilot_sidecar import decodesteps, llm_recommending
from batchpilot_triton import modelconfigs, repositories, scraping, servers

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
        server.wait_ready(240)
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


def engine_between(before: scraping.Snapshot, after: scraping.Snapshot) -> decodesteps.Sample:
    """The engine's mean step and running sequences between two readings of Triton's page, as
    the sidecar's fit takes them (`decodesteps.sample`)."""
    rates = scraping.rates(before, after)[MODEL]
    assert rates.engine is not None
    found = decodesteps.sample(rates.engine.inter_token, seconds=rates.seconds)
    assert found is not None, "the engine measured no gap between tokens"
    return found


def metrics_snapshot(server: local_triton.LocalTriton) -> scraping.Snapshot:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        return scraping.parse(response.read().decode(), taken_at=time.monotonic())


async def running_in_a_burst(server: local_triton.LocalTriton, size: int = 8) -> float:
    """Send `size` requests at once; how many sequences the engine ran on average while they
    lasted: the total time its sequences spent between tokens over the burst's length (Little's
    law, from the engine's histogram; its `running` gauge, set per step and read at any instant,
    reads low on busy seconds)."""
    before = await asyncio.to_thread(metrics_snapshot, server)
    burst = await llm_load.open_loop(
        server.grpc_address, rate=1000, seconds=size / 1000, prompt_tokens=32, output_tokens=96
    )
    after = await asyncio.to_thread(metrics_snapshot, server)
    assert all(completion.ok for completion in burst)
    return engine_between(before, after).running


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
    """The Python stubs and engine processes of the server: a reload replaces them."""
    return set(processes.group_members(server.pid)) - {server.pid}


def test_the_repository_model_json_is_what_the_engine_was_started_with(
    llm_server: local_triton.LocalTriton,
) -> None:
    base = repositories.read_repository_arguments(llm_server.model_repository, MODEL)
    assert base.version == "1"
    assert base.arguments == json.loads(
        (Path(llm_server.model_repository) / MODEL / "1" / "model.json").read_text()
    )
    assert base.arguments["model"] == str(llm_models.WEIGHTS_CONFIG)


def test_the_sidecar_s_ttft_inter_token_latency_and_tokens_agree_with_the_client_s(
    llm_server: local_triton.LocalTriton, tmp_path: Path
) -> None:
    with llm_sidecar(llm_server, tmp_path, rate_window=60) as sidecar:
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
                and engine_tokens >= 0.99 * client_tokens
            )

        # A last reading after it: the engine's statistics reach Triton a step late.
        report = sidecar_report(sidecar.url, until=counted_all)
    assert all(completion.ok for completion in completions)
    llm = report["llm"]
    client_ttft_ms = [1000 * c.ttft_seconds for c in completions if c.ttft_seconds is not None]
    client_itl_ms = [
        1000 * c.mean_inter_token_seconds
        for c in completions
        if c.mean_inter_token_seconds is not None
    ]
    engine_tokens = llm["outputTokensPerSecond"] * report["window"]["seconds"]
    ttft = (llm_load.percentile(client_ttft_ms, 0.5), llm_load.percentile(client_ttft_ms, 0.95))
    print(
        f"\nTTFT ms p50/p95: sidecar {llm['ttftP50Ms']} / {llm['ttftP95Ms']},"
        f" client {ttft[0]:.1f} / {ttft[1]:.1f}"
        f"\ninter-token ms p50: sidecar {llm['interTokenP50Ms']},"
        f" client (decode time per token) {llm_load.percentile(client_itl_ms, 0.5):.2f}"
        f"\noutput tokens: sidecar {engine_tokens:.0f}, client {client_tokens}"
    )
    assert llm["firstTokens"] == len(completions)
    assert engine_tokens == pytest.approx(client_tokens, rel=0.02)
    # The engine's TTFT is part of the client's (which adds gRPC, Triton and the client's own
    # event loop); its decode time per token is part of the client's gap between tokens.
    assert 0.4 * ttft[0] <= llm["ttftP50Ms"] <= 1.1 * ttft[0] + 5
    client_itl = llm_load.percentile(client_itl_ms, 0.5)
    assert 0.4 * client_itl <= llm["interTokenP50Ms"] <= 1.25 * client_itl


async def closed_loop(
    server: local_triton.LocalTriton, *, streams: int, seconds: float, output_tokens: int = 96
) -> list[llm_load.Completion]:
    """`streams` clients, each sending its next request once the last one ended, for `seconds`:
    the engine runs about `streams` sequences all along."""
    deadline = time.monotonic() + seconds
    async with triton_grpc.InferenceServerClient(server.grpc_address) as client:

        async def stream(index: int) -> list[llm_load.Completion]:
            done: list[llm_load.Completion] = []
            while time.monotonic() < deadline:
                text = llm_load.prompt(32, seed=index)
                done.append(
                    await llm_load.complete(
                        client, text, max_tokens=output_tokens, request_id=f"{index}-{len(done)}"
                    )
                )
            return done

        found = await asyncio.gather(*(stream(index) for index in range(streams)))
    return [completion for completions in found for completion in completions]


def model_status(url: str, query: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/status?{query}", timeout=5) as response:
        report: dict[str, Any] = json.loads(response.read())["models"][MODEL]
    return report


async def test_the_sidecar_fits_the_engine_s_step_time_and_recommends_its_limits(
    llm_server: local_triton.LocalTriton, tmp_path: Path
) -> None:
    objectives = "ttftP95Ms=500&itlP95Ms=20"
    limit = await room_for(llm_server, sequences=16)
    with llm_sidecar(llm_server, tmp_path, rate_window=3) as sidecar:
        for streams in (1, 2, 4, 8, 16):
            completions = await closed_loop(llm_server, streams=streams, seconds=3)
            assert all(completion.ok for completion in completions)
        # A steady load of 8 sequences, read while it lasts: the rate window holds only it.
        steady = asyncio.create_task(closed_loop(llm_server, streams=8, seconds=9))
        await asyncio.sleep(2)
        before = await asyncio.to_thread(metrics_snapshot, llm_server)
        await asyncio.sleep(4)
        after = await asyncio.to_thread(metrics_snapshot, llm_server)
        report = await asyncio.to_thread(model_status, sidecar.url, objectives)
        assert all(completion.ok for completion in await steady)
    # What the fit models: the mean gap between tokens (the engine's step) over the steady load,
    # against the sequences running, counted as the fit counts them.
    measured = engine_between(before, after)
    steady_step_ms, running = measured.mean_ms, measured.running
    llm = report["llm"]
    fit, recommendation = llm["stepTime"], llm["recommendation"]
    print(f"\nLLM step-time fit: {json.dumps(fit)}\nrecommendation: {json.dumps(recommendation)}")
    assert fit["status"] == "fitted", fit["reason"]
    fitted_ms = fit["t0Ms"] + fit["cMs"] * running ** fit["alpha"]
    print(
        f"at {running:g} running: fitted step {fitted_ms:.2f} ms, measured mean step "
        f"{steady_step_ms:.2f} ms (inter-token p50 {llm['interTokenP50Ms']} ms)"
    )
    assert running >= 4
    assert fitted_ms == pytest.approx(steady_step_ms, rel=0.3)
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
    before = await running_in_a_burst(llm_server)
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
    # The engine runs the new arguments: 2 sequences at once at most, where it ran more before.
    after = await running_in_a_burst(llm_server)
    print(
        f"\nswitch under streaming load: applied in {applied.seconds:.1f}s, "
        f"{len(completions)} streams, {len(failures)} failed; sequences running on average in "
        f"a burst of 8: {before:.2f} before, {after:.2f} after"
    )
    assert before > 3
    assert after <= 2.0


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
    assert stubs(llm_server) == running


async def test_the_runner_applies_a_policy_s_llm_profile_with_the_repository_it_reads(
    llm_server: local_triton.LocalTriton,
) -> None:
    spec = specs.parse_spec(
        {
            "target": {"selector": {}, "models": [MODEL]},
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
