"""The standalone runner against real tritonservers: ticks, drift repair, backoff, the CLI."""

from __future__ import annotations

import datetime
import functools
from pathlib import Path

import pytest
from prometheus_client import parser

from batchpilot import running, telemetry
from batchpilot.applying import backoffs
from batchpilot.signals import sources
from batchpilot_harness import demo_models, local_triton
from batchpilot_triton import modelconfigs, servers
from builders import make_spec, utc
from triton_fixtures import TritonFactory, run_command_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def policy(**fields: object) -> object:
    return make_spec(
        target={"selector": {"matchLabels": {"app": "triton"}}, "models": [demo_models.GPU_SIM]},
        **fields,
    )


TUESDAY_AFTERNOON = utc(2026, 11, 24, 15)


def runner_for(
    *urls: str, spec: object, clock: datetime.datetime = TUESDAY_AFTERNOON
) -> running.Runner:
    triton_servers = [servers.TritonServer(url, request_timeout=2) for url in urls]
    return running.Runner(
        name="test",
        spec=spec,  # type: ignore[arg-type]
        triton_servers=triton_servers,
        source=sources.TritonMetricsSource(triton_servers, models=[demo_models.GPU_SIM]),
        metrics=telemetry.controller_metrics(),
        clock=lambda: clock,
    )


async def served_profile(url: str) -> str | None:
    async with servers.TritonServer(url) as triton:
        return modelconfigs.applied_profile(await triton.model_config(demo_models.GPU_SIM))


@pytest.mark.timeout(120)
async def test_restarted_triton_is_brought_back_within_one_tick(tmp_path: Path) -> None:
    def start() -> local_triton.LocalTriton:
        return local_triton.LocalTriton(
            model_repository=demo_models.MODEL_REPOSITORY,
            models=[demo_models.GPU_SIM],
            http_port=ports[0],
            grpc_port=ports[1],
            metrics_port=ports[2],
            exit_timeout_seconds=1,
            run_directory=tmp_path / f"run-{len(started)}",
        )

    ports = local_triton.free_ports("127.0.0.1", 3)
    started: list[local_triton.LocalTriton] = []
    first = start()
    started.append(first)
    with first:
        runner = runner_for(first.http_url, spec=policy(defaultProfile="interactive"))
        report = await runner.tick()
        assert [o.state for o in report.outcomes] == ["Updated"]
        assert report.outcomes[0].reloads == 1
        assert await served_profile(first.http_url) == "interactive"
    second = start()
    started.append(second)
    with second:
        assert await served_profile(second.http_url) is None, "a restart forgets the profile"
        report = await runner.tick()
        assert report.outcomes[0].reloads == 1
        assert await served_profile(second.http_url) == "interactive"
        assert (await runner.tick()).outcomes[0].reloads == 0
        await runner.close()


@pytest.mark.timeout(60)
async def test_one_unreachable_server_backs_off_and_does_not_hold_up_the_others(
    triton_server: TritonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backoff longer than any tick, so that the second tick falls within it however slowly a
    # loaded machine runs the first (a 1-s backoff ran out during it in 2 of 3 runs).
    monkeypatch.setattr(backoffs, "Backoff", functools.partial(backoffs.Backoff, first=60.0))
    live = triton_server(demo_models.GPU_SIM)
    (dead_port,) = local_triton.free_ports("127.0.0.1", 1)
    dead = f"http://127.0.0.1:{dead_port}"
    runner = runner_for(dead, live.http_url, spec=policy(defaultProfile="bulk"))
    first = await runner.tick()
    assert [o.state for o in first.outcomes] == ["Unreachable", "Updated"]
    second = await runner.tick()
    # Within the backoff the dead server is not asked again.
    assert [o.state for o in second.outcomes] == ["Unreachable", "Updated"]
    assert second.outcomes[0].message == first.outcomes[0].message, "reported the same"
    assert await served_profile(live.http_url) == "bulk"
    errors = runner.metrics.registry.get_sample_value(
        "batchpilot_apply_errors_total",
        {"policy_namespace": "", "policy": "test", "reason": "unreachable"},
    )
    assert errors == 1, "a server left alone while it backs off is not counted again"
    await runner.close()


@pytest.mark.timeout(60)
async def test_dry_run_decides_but_changes_nothing(triton_server: TritonFactory) -> None:
    server = triton_server(demo_models.GPU_SIM)
    runner = runner_for(server.http_url, spec=policy(defaultProfile="interactive", dryRun=True))
    report = await runner.tick()
    assert report.decision.profile == "interactive"
    assert report.rollout is not None
    assert report.rollout.dry_run
    assert [o.state for o in report.outcomes] == ["Pending"]
    assert await served_profile(server.http_url) is None
    await runner.close()


@pytest.mark.timeout(60)
def test_run_command_applies_serves_metrics_and_stops_on_sigterm(
    triton_server: TritonFactory, tmp_path: Path
) -> None:
    server = triton_server(demo_models.GPU_SIM)
    runner = run_command_until(
        "apiVersion: batchpilot.dev/v1alpha1\nkind: BatchPolicy\n"
        "metadata: {name: cli, namespace: serving}\n"
        "spec:\n  target: {selector: {matchLabels: {app: triton}}, models: [gpu_sim]}\n"
        "  profiles: {bulk: {maxQueueDelayMicroseconds: 20000, preferredBatchSizes: [32]}}\n"
        "  defaultProfile: bulk\n",
        ["--triton", server.http_url, "--triton-metrics", server.metrics_url],
        tmp_path,
        until="applied bulk to gpu_sim",
    )
    output, metrics = runner.output, runner.metrics
    assert runner.returncode == 0, output
    # The document's namespace names the policy on its series, as the operator's do.
    active = {
        (tuple(sorted(sample.labels.items())), sample.value)
        for family in parser.text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == telemetry.ACTIVE_PROFILE
    }
    named = {"policy_namespace": "serving", "policy": "cli", "profile": "bulk"}
    assert active == {(tuple(sorted(named.items())), 1.0)}
    assert "switch to bulk: defaultProfile (no schedule windows)" in output
    assert output.rstrip().endswith("stopped")
