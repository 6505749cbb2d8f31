"""Servers a policy names may be slow, huge or hostile: every read of them ends at its deadline
or its size cap with a clear problem, keeps memory bounded, repeats none of an error answer's
body, and holds up nothing another policy needs (issue 26, findings 2, 3 and 4).

The hostile servers are real HTTP servers on loopback. A flood is generated as it is sent, so
"memory stays bounded" is checked by what the server managed to send before the reader hung
up: what was never sent cannot be in the reader's memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import engines, pod_repositories
from batchpilot.applying.replicas import Replica
from batchpilot.kube import client
from batchpilot.kube import pods as kube_pods
from batchpilot.signals import prometheus, sidecars, sources
from batchpilot_triton import responses, scraping, servers
from web_apps import ServeApp

MB = 1_000_000
FLOOD_BYTES = 500 * MB
"""What a flooding server offers."""
SENT_AT_MOST = 64 * 1024 * 1024
"""What one answer may get out before the reader hangs up: the cap plus socket and reader
buffers (about 10 MiB here)."""
SECRET = "hunter2-do-not-repeat"


class Hostile:
    """Routes that flood, trickle or refuse with a secret, and what they managed to send."""

    def __init__(self) -> None:
        self.most_sent = 0
        """The most bytes one answer got out."""
        self.requests = 0
        self.trickling = 0
        """Trickling answers in progress: requests the reader still holds open."""
        self.trickle_began = asyncio.Event()
        self.trickle_ended = asyncio.Event()
        self.hung_up = asyncio.Event()

    async def until_trickling(self, count: int) -> None:
        while self.trickling < count:
            self.trickle_began.clear()
            await self.trickle_began.wait()

    async def until_quiet(self) -> None:
        """Until every trickling answer has lost its reader."""
        while self.trickling:
            self.trickle_ended.clear()
            await self.trickle_ended.wait()

    async def flood(self, request: web.Request) -> web.StreamResponse:
        """A 200 whose body goes on for FLOOD_BYTES, sent a megabyte at a time."""
        self.requests += 1
        response = web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request)
        chunk = b" " * MB
        sent = 0
        try:
            await response.write(b'{"padding": "')
            while sent < FLOOD_BYTES:
                await response.write(chunk)
                sent += len(chunk)
                self.most_sent = max(self.most_sent, sent)
        except (ConnectionError, RuntimeError):
            self.hung_up.set()
        return response

    async def trickle(self, request: web.Request) -> web.StreamResponse:
        """A 200 that sends a byte every 50 ms for as long as the reader listens."""
        self.requests += 1
        self.trickling += 1
        self.trickle_began.set()
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b" ")
                await asyncio.sleep(0.05)
        except (ConnectionError, RuntimeError):
            self.hung_up.set()
        finally:
            self.trickling -= 1
            self.trickle_ended.set()
        return response

    async def refuse_with_secret(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = {"error": "internal failure " + "x" * 400 + f" password={SECRET}"}
        return web.json_response(body, status=500)


def hostile_app(hostile: Hostile, route: str, kind: str) -> web.Application:
    app = web.Application()
    handler = {
        "flood": hostile.flood,
        "trickle": hostile.trickle,
        "secret": hostile.refuse_with_secret,
    }[kind]
    app.router.add_route("*", route, handler)
    return app


@asynccontextmanager
async def header_trickler() -> AsyncIterator[str]:
    """A server that sends its status line and then its headers a byte every 50 ms, forever:
    no single socket read ever waits long, so only a deadline on the whole answer ends it."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while True:
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def prometheus_source(url: str, *, timeout: float = 1.0) -> prometheus.PrometheusSource:
    return prometheus.PrometheusSource(
        url, namespace="tenant-a", pods=["triton-0"], models=["gpu_sim"], timeout=timeout
    )


# --- Prometheus (findings 2, 3 and 4) ---------------------------------------------------------


@pytest.mark.timeout(20)
async def test_a_prometheus_trickling_its_body_is_cut_at_the_deadline(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/api/v1/query", "trickle"))
    source = prometheus_source(url, timeout=1.0)
    reading = await source.read()
    await source.close()
    assert reading.signals.metrics == {}
    asked = len(prometheus.queries(namespace="a", pods=["p"], models=["m"], window="1m"))
    assert reading.problems == (
        f"prometheus {url}: {asked} of {asked} queries unanswered within 1s",
    ), reading.problems
    await asyncio.wait_for(hostile.hung_up.wait(), 10)


@pytest.mark.timeout(20)
async def test_a_prometheus_trickling_its_headers_is_cut_at_the_deadline() -> None:
    async with header_trickler() as url:
        source = prometheus_source(url, timeout=1.0)
        reading = await source.read()
        await source.close()
    assert reading.signals.metrics == {}
    assert "unanswered within 1s" in reading.problems[0], reading.problems


@pytest.mark.timeout(30)
async def test_a_prometheus_streaming_hundreds_of_megabytes_is_cut_at_the_cap(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/api/v1/query", "flood"))
    source = prometheus_source(url, timeout=20.0)
    reading = await source.read()
    await source.close()
    assert reading.signals.metrics == {}
    assert "the answer is larger than 1 MiB; cut off there" in reading.problems[0]
    await asyncio.wait_for(hostile.hung_up.wait(), 10)
    assert hostile.most_sent < SENT_AT_MOST, f"{hostile.most_sent} bytes sent: read on and on"


@pytest.mark.timeout(20)
async def test_a_prometheus_error_answer_is_told_by_its_status_never_its_body(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/api/v1/query", "secret"))
    source = prometheus_source(url)
    reading = await source.read()
    await source.close()
    (problem,) = reading.problems
    assert problem.startswith(f"prometheus {url}: ")
    assert problem.endswith(": HTTP 500 Internal Server Error")
    assert SECRET not in problem
    assert "internal failure" not in problem


@pytest.mark.timeout(20)
async def test_credentials_in_the_prometheus_url_are_not_repeated(serve_app: ServeApp) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/elsewhere", "secret"))  # the query: 404
    source = prometheus_source(url.replace("http://", f"http://reader:{SECRET}@"))
    reading = await source.read()
    await source.close()
    (problem,) = reading.problems
    assert problem.startswith(f"prometheus {url}: ")
    assert problem.endswith(": HTTP 404 Not Found")
    assert SECRET not in problem


@pytest.mark.timeout(30)
async def test_no_prometheus_query_outlives_a_read_the_tick_gave_up_on(
    serve_app: ServeApp,
) -> None:
    """The operator bounds each tick's signals (reconciling.SIGNAL_TIMEOUT_SECONDS); a query
    cut there must end there, not hold its connection until its own deadline."""
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/api/v1/query", "trickle"))
    source = prometheus_source(url, timeout=60.0)
    reading = asyncio.ensure_future(source.read())
    await asyncio.wait_for(hostile.until_trickling(1), timeout=20)
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await asyncio.wait_for(hostile.until_quiet(), timeout=20)
    await source.close()


# --- Isolation (finding 2) -------------------------------------------------------------------


def pods_of_tenant_b() -> kube_pods.Pods:
    """Tenant B's Pods as a tick finds them: in the operator's watch-fed index."""
    reader = kube_pods.Pods(client.KubeClient())
    pod = {
        "metadata": {"name": "triton-b", "labels": {"app": "triton"}},
        "spec": {"containers": [{"name": "triton", "ports": []}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }
    reader.index = {"tenant-b": [kube_pods.snapshot(pod)]}
    return reader


def healthy_prometheus(value: float) -> web.Application:
    async def query(request: web.Request) -> web.Response:
        answer = {"resultType": "vector", "result": [{"metric": {}, "value": [0, str(value)]}]}
        return web.json_response({"status": "success", "data": answer})

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    return app


@pytest.mark.timeout(60)
async def test_a_trickling_prometheus_of_one_policy_holds_nothing_another_policy_needs(
    serve_app: ServeApp,
) -> None:
    """Policy A's Prometheus trickles; while A's reads hang, policy B lists its Pods through
    the Kubernetes client (which runs in the event loop's default thread pool) and reads its
    own Prometheus. The pool is the size the default one has on a 2-core node."""
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(max_workers=6)
    )
    hostile = Hostile()
    trickling = await serve_app(hostile_app(hostile, "/api/v1/query", "trickle"))
    tenant_b_pods = pods_of_tenant_b()
    policy_a = prometheus_source(trickling, timeout=45.0)
    policy_b = prometheus.PrometheusSource(
        await serve_app(healthy_prometheus(120.0)),
        namespace="tenant-b",
        pods=["triton-b"],
        models=["gpu_sim"],
    )
    # Two ticks of A, as its loop would run them, both hanging on the trickle.
    a_reads = [asyncio.ensure_future(policy_a.read()) for _ in range(2)]
    try:
        await asyncio.wait_for(hostile.until_trickling(4), timeout=30)
        target = specs.Target.model_validate(
            {"selector": {"matchLabels": {"app": "triton"}}, "models": ["gpu_sim"]}
        )
        b_pods, b_reading = await asyncio.wait_for(
            asyncio.gather(tenant_b_pods.replicas("tenant-b", target), policy_b.read()),
            timeout=30,
        )
        a_still_hanging = not any(read.done() for read in a_reads) and hostile.trickling >= 4
    finally:
        for read in a_reads:
            read.cancel()
        await asyncio.gather(*a_reads, return_exceptions=True)
        await policy_a.close()
        await policy_b.close()
    assert a_still_hanging, "B was served while A's reads were still hanging"
    assert [replica.name for replica in b_pods[0]] == ["triton-b"]
    assert b_reading.problems == ()
    assert b_reading.signals.metrics["queueDepth"] == 120.0


# --- Sidecars (findings 3 and 4) --------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_a_sidecar_streaming_hundreds_of_megabytes_is_cut_at_the_cap(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/status", "flood"))
    source = sidecars.SidecarSource([url], models=["gpu_sim"], slo=None, timeout=20.0)
    reading = await source.read()
    await source.close()
    assert reading.problems == (f"sidecar {url}: the answer is larger than 2 MiB; cut off there",)
    await asyncio.wait_for(hostile.hung_up.wait(), 10)
    assert hostile.most_sent < SENT_AT_MOST, f"{hostile.most_sent} bytes sent: read on and on"


@asynccontextmanager
async def malformed_answerer() -> AsyncIterator[str]:
    """A server whose answer has a malformed header a thousand characters long ending in a
    secret: aiohttp's parser quotes the line it choked on in its error."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        header = b"X-Bad\x01: " + b"y" * 1000 + SECRET.encode()
        writer.write(b"HTTP/1.1 200 OK\r\n" + header + b"\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.timeout(20)
async def test_a_sidecar_s_malformed_answer_is_told_by_its_kind_never_its_bytes() -> None:
    async with malformed_answerer() as url:
        source = sidecars.SidecarSource([url], models=["gpu_sim"], slo=None)
        reading = await source.read()
        await source.close()
    (problem,) = reading.problems
    assert problem == (
        f"sidecar {url}: the answer could not be read (ClientResponseError, HTTP 400)"
    )


def replica_with_sidecar(sidecar_url: str) -> Replica:
    return Replica(
        name="triton-0", http_url="http://127.0.0.1:9", sidecar_url=sidecar_url, kind="pod"
    )


@pytest.mark.timeout(30)
async def test_engine_arguments_streaming_hundreds_of_megabytes_are_cut_at_the_cap(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/v1/models/{model}/engine-arguments", "flood"))
    source = pod_repositories.SidecarEngineArguments(timeout=20.0)
    with pytest.raises(engines.EngineArgumentsUnavailable) as refused:
        await source.repository_arguments(replica_with_sidecar(url), "tiny_llm")
    assert str(refused.value).endswith("the answer is larger than 1 MiB; cut off there")
    await asyncio.wait_for(hostile.hung_up.wait(), 10)
    assert hostile.most_sent < SENT_AT_MOST, f"{hostile.most_sent} bytes sent: read on and on"


# --- Triton (findings 3 and 4) ----------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_a_metrics_page_of_hundreds_of_megabytes_is_cut_at_the_cap(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/metrics", "flood"))
    triton = servers.TritonServer(url, metrics_url=f"{url}/metrics", request_timeout=20.0)
    with pytest.raises(servers.Unreachable) as cut:
        await triton.metrics_text()
    await triton.close()
    assert cut.value.message == "metrics: the answer is larger than 4 MiB; cut off there"
    await asyncio.wait_for(hostile.hung_up.wait(), 10)
    assert hostile.most_sent < SENT_AT_MOST, f"{hostile.most_sent} bytes sent: read on and on"


@pytest.mark.timeout(30)
async def test_a_model_config_of_hundreds_of_megabytes_is_cut_at_the_cap(
    serve_app: ServeApp,
) -> None:
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/v2/models/{model}/config", "flood"))
    async with servers.TritonServer(url, request_timeout=20.0) as triton:
        with pytest.raises(servers.TritonError) as cut:
            await triton.model_config("gpu_sim")
    assert "larger than 4 MiB" in cut.value.message
    await asyncio.wait_for(hostile.hung_up.wait(), 10)
    assert hostile.most_sent < SENT_AT_MOST, f"{hostile.most_sent} bytes sent: read on and on"


@pytest.mark.parametrize("files", [None, {"1/model.json": b"{}"}], ids=["config", "files"])
@pytest.mark.timeout(20)
async def test_a_triton_error_answer_is_quoted_as_a_short_excerpt(
    serve_app: ServeApp, files: dict[str, bytes] | None
) -> None:
    """Both loads: with a config override only, and with file overrides too."""
    hostile = Hostile()
    url = await serve_app(hostile_app(hostile, "/v2/repository/models/{model}/load", "secret"))
    async with servers.TritonServer(url) as triton:
        with pytest.raises(servers.LoadRejected) as refused:
            await triton.load("gpu_sim", {"name": "gpu_sim"}, files=files)
    message = refused.value.message
    assert message.startswith("load of gpu_sim: internal failure xxx")
    assert len(message) <= len("load of gpu_sim: ") + responses.EXCERPT_CHARS
    assert SECRET not in message


# --- The pieces -------------------------------------------------------------------------------


def test_an_excerpt_is_one_short_printable_line() -> None:
    assert responses.excerpt("line one\nline\ttwo\x1b[31m") == "line one line two [31m"
    long = responses.excerpt("y" * 1000, 20)
    assert long == "y" * 19 + "…"


def test_sizes_are_told_in_the_units_they_were_set_in() -> None:
    assert responses.size_text(8 * responses.MIB) == "8 MiB"
    assert responses.size_text(16 * responses.KIB) == "16 KiB"
    assert responses.size_text(1000) == "1000 bytes"


async def test_a_prometheus_named_by_host_name_is_looked_up_on_the_source_s_own_thread(
    serve_app: ServeApp,
) -> None:
    url = await serve_app(healthy_prometheus(3.0))
    source = prometheus_source(url.replace("127.0.0.1", "localhost"), timeout=10)
    reading = await source.read()
    lookups = [t for t in threading.enumerate() if t.name.startswith("batchpilot-resolver")]
    await source.close()
    assert reading.problems == ()
    assert reading.signals.metrics["queueDepth"] == 3.0
    assert len(lookups) == 1, "one lookup thread, for the source's ten queries"
    await asyncio.to_thread(lookups[0].join, 10)
    assert not lookups[0].is_alive(), "closing the source ends its lookup thread"


def large_metrics_page(series: int) -> str:
    """A valid Triton metrics page: many models' success counts, about 65 bytes a series."""
    header = "# TYPE nv_inference_request_success counter\n"
    line = 'nv_inference_request_success{{model="model_{0}",version="1"}} {0}\n'
    return header + "".join(line.format(number) for number in range(series))


def serving_page(page: str) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


@pytest.mark.timeout(30)
async def test_a_metrics_page_of_too_many_series_is_refused_unparsed(
    serve_app: ServeApp,
) -> None:
    """Under the byte cap, but parsing it would take more memory than the operator has."""
    url = await serve_app(serving_page(large_metrics_page(responses.METRICS_PAGE_LINES + 1)))
    triton = servers.TritonServer(url, metrics_url=f"{url}/metrics")
    source = sources.TritonMetricsSource([triton], models=["model_1"])
    reading = await source.read()
    await triton.close()
    assert reading.problems == (f"{url}: metrics: the page has more than 20000 lines; not parsed",)


@pytest.mark.timeout(60)
async def test_a_large_metrics_page_is_parsed_while_the_event_loop_runs(
    serve_app: ServeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page under the caps but a megabyte long takes a second or so to parse: the event
    loop every policy shares keeps running meanwhile."""
    url = await serve_app(serving_page(large_metrics_page(responses.METRICS_PAGE_LINES - 10)))
    parsing = threading.Event()
    parse = scraping.parse

    def watched_parse(text: str, *, taken_at: float = 0.0) -> scraping.Snapshot:
        parsing.set()
        try:
            return parse(text, taken_at=taken_at)
        finally:
            parsing.clear()

    monkeypatch.setattr(scraping, "parse", watched_parse)
    loop_ran_during_parse = False

    async def heartbeat() -> None:
        nonlocal loop_ran_during_parse
        while True:
            loop_ran_during_parse |= parsing.is_set()
            await asyncio.sleep(0.001)

    beating = asyncio.ensure_future(heartbeat())
    triton = servers.TritonServer(url, metrics_url=f"{url}/metrics", request_timeout=30.0)
    source = sources.TritonMetricsSource([triton], models=["model_1"])
    try:
        reading = await source.read()
    finally:
        beating.cancel()
        await triton.close()
    assert reading.problems == ()
    assert loop_ran_during_parse, "the event loop stood still while the page was parsed"
