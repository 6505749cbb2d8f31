"""The repository credential goes to Triton and nowhere else, and nothing a policy's author
reads ever repeats it; no client follows a redirect; a Prometheus URL is an address, never a
query (issue 39, findings 1, 2 and 3). Each refusal of a policy is checked twice: by the parser
and by the CRD as the API server applies it (`crd_checks`).

The servers are real HTTP servers on loopback, each written as the attacker would want them:
one that quotes back every request header (in its body, in its `error`, in its reason phrase),
one that answers as the sidecar does (any port that is not Triton's), one that redirects.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import crd_checks
import prometheus_client
import pydantic
import pytest
from aiohttp import web

import sidecar_builders
from batchpilot import running, telemetry
from batchpilot.api import documents
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import credentials, engines, pod_repositories
from batchpilot.applying.replicas import Replica
from batchpilot.policy import decisions
from batchpilot.signals import prometheus, sidecars, sources
from batchpilot_triton import servers
from builders import spec_document
from fake_triton import FakeTriton
from web_apps import ServeApp

TOKEN = "s3cr3t-repository-token-5f2a9c"
HEADER = specs.DEFAULT_REPOSITORY_HEADER
TRITON_METADATA = {"name": "triton", "version": "2.50.0", "extensions": ["model_repository"]}


def quoted_headers(request: web.Request) -> str:
    return "; ".join(f"{name}: {value}" for name, value in request.headers.items())


def echoing_triton(style: str, seen: list[dict[str, str]]) -> web.Application:
    """A server that says it is Triton, then quotes every header of a repository call back in
    its error answer: in a plain body, in Triton's own `error`, or in its reason phrase."""

    async def metadata(request: web.Request) -> web.Response:
        return web.json_response(TRITON_METADATA)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def config(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        return web.json_response({"name": name, "max_batch_size": 8, "dynamic_batching": {}})

    async def repository(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        quoted = quoted_headers(request)
        if style == "json":
            return web.json_response({"error": f"bad request ({quoted})"}, status=400)
        if style == "cut":  # the value where an excerpt of 160 characters cuts it
            said = "y" * 150 + str(request.headers.get(HEADER))
            return web.json_response({"error": said}, status=400)
        if style == "reason":
            return web.Response(status=400, reason=f"Bad {request.headers.get(HEADER)}")
        return web.Response(status=400, text=f"Invalid character in header: {quoted}")

    app = web.Application()
    app.router.add_get("/v2", metadata)
    app.router.add_get("/v2/health/{kind}", ok)
    app.router.add_get("/v2/models/{model}/ready", ok)
    app.router.add_get("/v2/models/{model}/config", config)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v2/repository/index", repository)
    app.router.add_post("/v2/repository/models/{model}/{verb}", repository)
    return app


def recording_app(seen: list[dict[str, str]]) -> web.Application:
    """Anything that is not Triton (the sidecar's port, a proxy): it records what reaches it,
    and quotes it back."""

    async def anything(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.Response(status=400, text=f"Invalid header: {quoted_headers(request)}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


@pytest.mark.parametrize("style", ["text", "json", "cut", "reason"])
@pytest.mark.timeout(30)
async def test_no_output_of_a_run_repeats_the_credential_a_server_quoted_back(
    serve_app: ServeApp,
    style: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Status, events, conditions, log lines, printed output and metrics of the runner (the
    operator's reconciler under it) are searched for the value."""
    seen: list[dict[str, str]] = []
    url = await serve_app(echoing_triton(style, seen))
    spec = documents.parse_spec(
        spec_document(
            target={
                "selector": {"matchLabels": {"app": "triton"}},
                "models": ["gpu_sim"],
                "repositoryCredential": {"secretName": "triton-credential"},
            }
        )
    )
    metrics = telemetry.controller_metrics()
    server = servers.TritonServer(url, metrics_url=f"{url}/metrics")
    runner = running.Runner(
        name="leaky",
        spec=spec,
        triton_servers=[server],
        source=_NoSignals(),
        metrics=metrics,
        credential_source=credentials.GivenCredential(TOKEN, source="test"),
    )
    caplog.set_level(logging.DEBUG)
    try:
        reports = [await runner.tick(), await runner.tick()]
    finally:
        await runner.close()
    assert seen, "the repository call reached the server, with the credential"
    assert all(headers.get(HEADER) == TOKEN for headers in seen)
    outputs = {
        "status": json.dumps(runner.status),
        "events": repr([report.events for report in reports]),
        "outcomes": repr([report.outcomes for report in reports]),
        "log": caplog.text,
        "printed": "".join(capsys.readouterr()),
        "metrics": prometheus_client.generate_latest(metrics.registry).decode(),
    }
    assert "model index" in outputs["log"], "the failed call was reported"
    assert [where for where, text in outputs.items() if TOKEN in text] == []
    assert [where for where, text in outputs.items() if TOKEN[:8] in text] == [], "a cut value"


class _NoSignals:
    async def read(self) -> sources.Reading:
        return sources.Reading(signals=decisions.Signals())

    async def close(self) -> None:
        pass


# --- Finding 1: the header's name, and where the header goes -----------------------------------


@pytest.mark.parametrize(
    "header",
    [
        "content-length",
        "expect",
        "host",
        "connection",
        "transfer-encoding",
        "te",
        "upgrade",
        "authorization",
        "proxy-authorization",
        "cookie",
        "x-forwarded-for",
        "batchpilot-",
        "Batchpilot-Token",
    ],
)
def test_a_header_that_http_or_a_proxy_acts_on_is_refused(header: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="header"):
        specs.RepositoryCredential.model_validate({"secretName": "s", "header": header})
    credential = {"secretName": "s", "header": header}
    assert crd_checks.admission_errors(locked_spec(credential)) != []


def test_the_credential_header_is_named_under_a_prefix_no_standard_header_has() -> None:
    for header in (HEADER, "batchpilot-admin-key", "triton-repository-token"):
        credential = {"secretName": "s", "header": header}
        assert specs.RepositoryCredential.model_validate(credential)
        assert crd_checks.admission_errors(locked_spec(credential)) == []


def locked_spec(credential: dict[str, str]) -> dict[str, Any]:
    return spec_document(
        target={"selector": {"matchLabels": {"app": "t"}}, "repositoryCredential": credential}
    )


@pytest.mark.parametrize("header", [HEADER, "content-length"])
@pytest.mark.timeout(30)
async def test_the_credential_is_never_sent_to_a_port_that_is_not_triton_s(
    serve_app: ServeApp, header: str
) -> None:
    """A policy naming the sidecar's port (or any other) for Triton's: nothing reaches it with
    the credential, and what it would say is not repeated. `content-length` is what an object
    stored before the header's pattern, or the runner's own policy file, could still name."""
    seen: list[dict[str, str]] = []
    url = await serve_app(recording_app(seen))
    async with servers.TritonServer(url, repository_headers={header: TOKEN}) as server:
        with pytest.raises(servers.TritonError) as refused:
            await server.load("gpu_sim", {"name": "gpu_sim"})
        with pytest.raises(servers.TritonError):
            await server.repository_index()
    assert [headers for headers in seen if TOKEN in json.dumps(headers)] == []
    assert TOKEN not in str(refused.value)
    assert "spec.target.port must name Triton's HTTP port" in str(refused.value)
    assert isinstance(refused.value, servers.NotTriton)


@pytest.mark.timeout(30)
async def test_the_real_sidecar_named_as_triton_gets_no_credential_and_is_not_quoted() -> None:
    """The finding as reported: the sidecar's port for Triton's, a header its HTTP server chokes
    on; its 400 quoted the header line, value and all."""
    async with (
        sidecar_builders.serving_app(
            sidecar_builders.make_collector(FakeTriton(), sidecar_builders.Clock())
        ) as url,
        servers.TritonServer(url, repository_headers={"expect": TOKEN}) as server,
    ):
        with pytest.raises(servers.TritonError) as refused:
            await server.load("gpu_sim", {"name": "gpu_sim"})
    assert TOKEN not in str(refused.value)
    assert "spec.target.port must name Triton's HTTP port" in str(refused.value)


# --- Finding 2: redirects ------------------------------------------------------------------------


def redirecting_app(to: str) -> web.Application:
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"{to}{request.path_qs}")

    async def metadata(request: web.Request) -> web.Response:
        return web.json_response(TRITON_METADATA)

    app = web.Application()
    app.router.add_get("/v2", metadata)
    app.router.add_route("*", "/{tail:.*}", redirect)
    return app


async def _triton_load(url: str) -> str:
    async with servers.TritonServer(url, repository_headers={HEADER: TOKEN}) as server:
        with pytest.raises(servers.TritonError) as refused:
            await server.load("gpu_sim", {"name": "gpu_sim"})
    return str(refused.value)


async def _triton_config(url: str) -> str:
    async with servers.TritonServer(url) as server:
        with pytest.raises(servers.TritonError) as refused:
            await server.model_config("gpu_sim")
    return str(refused.value)


async def _sidecar_status(url: str) -> str:
    source = sidecars.SidecarSource([url], models=["gpu_sim"], slo=None)
    try:
        reading = await source.read()
    finally:
        await source.close()
    return " ".join(reading.problems)


async def _engine_arguments(url: str) -> str:
    replica = Replica(name="triton-0", http_url="http://127.0.0.1:9", sidecar_url=url, kind="pod")
    with pytest.raises(engines.EngineArgumentsUnavailable) as refused:
        await pod_repositories.SidecarEngineArguments().repository_arguments(replica, "tiny_llm")
    return str(refused.value)


async def _prometheus(url: str) -> str:
    source = prometheus.PrometheusSource(url, namespace="ns", pods=["p"], models=["m"])
    try:
        reading = await source.read()
    finally:
        await source.close()
    return " ".join(reading.problems)


@pytest.mark.parametrize(
    "client",
    [_triton_load, _triton_config, _sidecar_status, _engine_arguments, _prometheus],
    ids=["triton-repository", "triton", "sidecar", "engine-arguments", "prometheus"],
)
@pytest.mark.timeout(30)
async def test_no_client_follows_a_redirect(serve_app: ServeApp, client: Any) -> None:
    """Every client the operator and the runner hold: a redirect is an error, the address it
    names is never asked (with the credential or without), and is not repeated."""
    seen: list[dict[str, str]] = []
    elsewhere = await serve_app(recording_app(seen))
    url = await serve_app(redirecting_app(elsewhere))
    problem = await client(url)
    assert seen == []
    assert "redirect" in problem
    assert elsewhere not in problem


# --- Finding 3: the Prometheus URL ---------------------------------------------------------------


def prometheus_spec(url: str) -> dict[str, Any]:
    return spec_document(load={"source": "prometheus", "prometheus": {"url": url}})


@pytest.mark.parametrize(
    "url",
    [
        "http://prometheus:9090/api/v1/query?query=vector(1e9)#",
        "http://prometheus:9090/?query=up",
        "http://prometheus:9090#/api",
        "http://user:password@prometheus:9090",
        "http://prometheus:9090/a b",
        "ftp://prometheus:9090",
        "http://",
    ],
)
def test_a_prometheus_url_with_more_than_an_address_is_refused(url: str) -> None:
    with pytest.raises(documents.PolicyError, match=r"prometheus\.url"):
        documents.parse_spec(prometheus_spec(url))
    assert crd_checks.admission_errors(prometheus_spec(url)) != []


@pytest.mark.parametrize(
    "url",
    [
        "http://prometheus.monitoring:9090",
        "https://prometheus.monitoring.svc.cluster.local:9090/",
        "http://10.0.0.5:9090/prometheus",
        "http://[fd00::5]:9090",
    ],
)
def test_a_prometheus_url_of_scheme_host_port_and_path_is_taken(url: str) -> None:
    assert documents.parse_spec(prometheus_spec(url)).load.prometheus is not None
    assert crd_checks.admission_errors(prometheus_spec(url)) == []


# --- Finding 6: bounds of what a policy selects and names ---------------------------------------


def target_spec(**target: Any) -> dict[str, Any]:
    return spec_document(target={"selector": {"matchLabels": {"app": "t"}}, **target})


@pytest.mark.parametrize(
    "target",
    [
        {"selector": {"matchExpressions": [{"key": "unused", "operator": "DoesNotExist"}]}},
        {"selector": {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["x"]}]}},
        {"selector": {"matchLabels": {f"k{n}": "v" for n in range(17)}}},
        {"selector": {"matchLabels": {"app": "v" * 64}}},
        {"selector": {"matchLabels": {"k" * 318: "v"}}},
        {"port": 70000},
        {"port": 0},
        {"port": "70000"},
        {"port": "p" * 5000},
        {"sidecarPort": "Not_A_Name"},
    ],
)
def test_a_target_without_bounds_is_refused(target: dict[str, Any]) -> None:
    with pytest.raises(documents.PolicyError):
        documents.parse_spec(target_spec(**target))
    assert crd_checks.admission_errors(target_spec(**target)) != []


@pytest.mark.parametrize(
    "target",
    [
        {"selector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}},
        {
            "selector": {
                "matchExpressions": [
                    {"key": "app", "operator": "In", "values": ["triton"]},
                    {"key": "canary", "operator": "DoesNotExist"},
                ]
            }
        },
        {"port": 65535, "sidecarPort": "sidecar"},
        {"port": "8000", "sidecarPort": "batchpilot-side"},
    ],
)
def test_a_bounded_target_is_taken(target: dict[str, Any]) -> None:
    assert documents.parse_spec(target_spec(**target))
    assert crd_checks.admission_errors(target_spec(**target)) == []


def reason_app(reason: str) -> web.Application:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=503, reason=reason)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    return app


@pytest.mark.parametrize("client", [_sidecar_status, _prometheus], ids=["sidecar", "prometheus"])
@pytest.mark.timeout(30)
async def test_a_reason_phrase_of_the_server_s_own_is_not_repeated(
    serve_app: ServeApp, client: Any
) -> None:
    """An address a policy names may answer anything in its status line: what comes back is
    the status and its standard phrase."""
    url = await serve_app(reason_app("internal-db.corp:5432 password=hunter2"))
    problem = await client(url)
    assert problem.endswith("HTTP 503 Service Unavailable")
    assert "hunter2" not in problem
