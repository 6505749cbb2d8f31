"""The operator's one client: each whole call bounded by its deadline and its answer by a size
cap, one error whatever failed (no refusal's body repeated), a login that kopf shares, and Events
posted as news (a failure is logged, never raised). The API servers are real HTTP servers on
loopback."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import kopf
import pytest
from aiohttp import web

from batchpilot.kube import client, events, logins
from web_apps import ServeApp

SECRET = "hunter2-do-not-repeat"


def logged_in(url: str, token: str = "t0k3n") -> client.KubeClient:
    return client.KubeClient(lambda: kopf.ConnectionInfo(server=url, token=token), timeout=2.0)


class ApiServer:
    """Answers every request with the next of `answers` (status, body), recording each."""

    def __init__(self, *answers: tuple[int, Any]) -> None:
        self.answers = list(answers)
        self.seen: list[dict[str, Any]] = []

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(
            {
                "method": request.method,
                "path": request.path,
                "type": request.content_type,
                "auth": request.headers.get("Authorization"),
                "body": await request.json() if request.can_read_body else None,
            }
        )
        status, body = self.answers.pop(0)
        if body == "trickle":
            response = web.StreamResponse()
            await response.prepare(request)
            for _ in range(600):  # a byte every 50 ms: 30 s at most, far past the deadline
                await response.write(b" ")
                await asyncio.sleep(0.05)
            return response
        if body == "flood":
            response = web.StreamResponse()
            await response.prepare(request)
            for _ in range(64):  # 64 MiB, generated as it is sent
                await response.write(b" " * 1024 * 1024)
            return response
        return web.json_response(body, status=status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.answer)
        return app


async def test_a_request_goes_to_its_path_with_its_body_type_and_credential(
    serve_app: ServeApp,
) -> None:
    server = ApiServer((200, {"kind": "Pod"}))
    kube = logged_in(await serve_app(server.app()))
    path = client.namespaced("v1", "team-a", "pods", "triton-0", "status")
    answer = await kube.request(
        "setting a gate", "PATCH", path, body={"a": 1}, content_type="application/merge-patch+json"
    )
    await kube.close()
    assert answer == {"kind": "Pod"}
    assert server.seen == [
        {
            "method": "PATCH",
            "path": "/api/v1/namespaces/team-a/pods/triton-0/status",
            "type": "application/merge-patch+json",
            "auth": "Bearer t0k3n",
            "body": {"a": 1},
        }
    ]


def test_paths_name_the_group_and_quote_every_segment() -> None:
    assert client.namespaced(
        "batchpilot.dev/v1alpha1", "ns", "batchpolicies", "desk", "status"
    ) == ("/apis/batchpilot.dev/v1alpha1/namespaces/ns/batchpolicies/desk/status")
    assert client.namespaced("v1", "ns", "events") == "/api/v1/namespaces/ns/events"
    assert (
        client.namespaced("v1", "ns", "secrets", "a/../b")
        == "/api/v1/namespaces/ns/secrets/a%2F..%2Fb"
    )


@pytest.mark.timeout(30)
async def test_an_api_server_that_trickles_is_left_at_the_deadline_of_the_whole_call(
    serve_app: ServeApp,
) -> None:
    """A byte every 50 ms never lets a per-read timeout fire: the whole call's deadline ends it."""
    url = await serve_app(ApiServer((200, "trickle")).app())
    kube = client.KubeClient(lambda: kopf.ConnectionInfo(server=url), timeout=0.5)
    started = asyncio.get_running_loop().time()
    with pytest.raises(client.KubeError) as raised:
        await kube.request("reading a Secret", "GET", "/api/v1/namespaces/a/secrets/b")
    waited = asyncio.get_running_loop().time() - started
    await kube.close()
    assert (raised.value.status, str(raised.value)) == (None, "reading a Secret: no answer in time")
    assert waited < 10, "the trickle held the call"


@pytest.mark.timeout(30)
async def test_a_login_that_hangs_holds_neither_the_loop_nor_the_call_past_its_deadline() -> None:
    """A kubeconfig's exec plugin that never answers: the Kubernetes client waits on it with no
    deadline, so the login runs on a thread of its own and the call ends at its deadline."""
    release = threading.Event()

    def hangs() -> kopf.ConnectionInfo:
        release.wait(20)
        return kopf.ConnectionInfo(server="http://127.0.0.1:9")

    kube = client.KubeClient(hangs, timeout=0.3)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.ensure_future(tick())
    try:
        with pytest.raises(client.KubeError) as raised:
            await kube.request("reading a Secret", "GET", "/api/v1/namespaces/a/secrets/b")
    finally:
        release.set()
        ticking.cancel()
    assert (raised.value.status, raised.value.reason) == (None, "no answer in time")
    assert ticks >= 5, "the event loop was held while logging in"


@pytest.mark.timeout(30)
async def test_a_login_that_never_returns_holds_only_its_own_thread_and_a_bounded_few() -> None:
    """Reading a kubeconfig has no deadline (a FIFO, a hung mount). The login after one that
    hung runs at once on a thread of its own, not queued behind it; past MAX_RUNNING_LOGINS
    hung ones, a login fails at once, saying why; once they return, logins work again."""
    release = threading.Event()

    def hangs() -> kopf.ConnectionInfo:
        release.wait(20)
        return kopf.ConnectionInfo(server="http://127.0.0.1:9")

    def answers() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server="http://127.0.0.1:10")

    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.log_in(hangs)
        async with asyncio.timeout(5):
            assert (await client.log_in(answers)).server == "http://127.0.0.1:10"
        for _ in range(client.MAX_RUNNING_LOGINS - 1):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await client.log_in(hangs)
        with pytest.raises(kopf.LoginError, match="earlier logins have not returned"):
            await client.log_in(answers)
    finally:
        release.set()
    async with asyncio.timeout(5):
        while True:  # the hung threads return and count no more
            try:
                info = await client.log_in(answers)
            except kopf.LoginError:
                await asyncio.sleep(0.05)
                continue
            break
    assert info.server == "http://127.0.0.1:10"


async def test_a_login_s_error_reaches_its_caller() -> None:
    def fails() -> kopf.ConnectionInfo:
        raise kopf.LoginError("no kubeconfig")

    with pytest.raises(kopf.LoginError, match="no kubeconfig"):
        await client.log_in(fails)


@pytest.mark.timeout(30)
async def test_an_answer_over_the_cap_is_cut_off_there(serve_app: ServeApp) -> None:
    url = await serve_app(ApiServer((200, "flood")).app())
    kube = client.KubeClient(
        lambda: kopf.ConnectionInfo(server=url), timeout=20.0, max_answer_bytes=1024 * 1024
    )
    with pytest.raises(client.KubeError) as raised:
        await kube.request("reading a Secret", "GET", "/api/v1/namespaces/a/secrets/b")
    await kube.close()
    assert (raised.value.status, raised.value.reason) == (None, "an answer over 1048576 bytes")


async def test_a_refusal_is_its_status_and_reason_never_its_body(serve_app: ServeApp) -> None:
    server = ApiServer((403, {"message": f"forbidden, password={SECRET}"}))
    kube = logged_in(await serve_app(server.app()))
    with pytest.raises(client.KubeError) as raised:
        await kube.request("reading a Secret", "GET", "/api/v1/namespaces/a/secrets/b")
    await kube.close()
    assert (raised.value.status, raised.value.reason) == (403, "Forbidden")
    assert SECRET not in str(raised.value)


async def test_no_server_is_no_connection() -> None:
    kube = logged_in("http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(client.KubeError) as raised:
        await kube.request("posting an event", "POST", "/api/v1/namespaces/a/events", body={})
    await kube.close()
    assert raised.value.status is None
    assert raised.value.reason.startswith("no connection (")


async def test_a_401_logs_in_again_once_and_a_second_is_the_error(serve_app: ServeApp) -> None:
    server = ApiServer((401, {}), (200, {"ok": True}), (401, {}), (401, {}))
    url = await serve_app(server.app())
    tokens = iter(["old", "rotated", "rotated", "rotated"])
    kube = client.KubeClient(lambda: kopf.ConnectionInfo(server=url, token=next(tokens)))
    assert await kube.request("reading a Secret", "GET", "/api/v1/namespaces/a/secrets/b") == {
        "ok": True
    }
    with pytest.raises(client.KubeError) as raised:
        await kube.request("reading a Secret", "GET", "/api/v1/namespaces/a/secrets/b")
    await kube.close()
    assert [seen["auth"] for seen in server.seen] == [
        "Bearer old", "Bearer rotated", "Bearer rotated", "Bearer rotated"
    ]  # fmt: skip
    assert raised.value.status == 401


def service_account(folder: Path) -> Path:
    folder.mkdir()
    (folder / "token").write_text("sa-token\n")
    (folder / "namespace").write_text("batchpilot-system")
    return folder


def test_in_a_pod_it_logs_in_with_its_service_account_at_the_kubelet_s_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    info = client.login(service_account=service_account(tmp_path / "sa"))
    assert (info.server, info.token, info.default_namespace) == (
        "https://10.96.0.1:443", "sa-token", "batchpilot-system"
    )  # fmt: skip


def kubeconfig(path: Path, user: dict[str, Any]) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        f"users: [{{name: u, user: {user}}}]\n"
    )
    return path


def test_outside_a_pod_it_logs_in_as_the_kubeconfig_s_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", {"token": "user-token"})))
    assert not logins.needs_the_client()
    info = client.login(service_account=tmp_path / "no-sa")
    assert (info.server, info.token) == ("https://127.0.0.1:6443", "user-token")
    provider = {"auth-provider": {"name": "oidc", "config": {"idp-issuer-url": "https://x"}}}
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "provider", provider)))
    assert logins.needs_the_client(), "only the client refreshes a legacy auth provider"
    exec_plugin = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "gcloud"}}
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "exec", exec_plugin)))
    assert not logins.needs_the_client(), "an exec plugin is run without the client"


def plugin(folder: Path, body: str) -> Path:
    """An exec plugin: a Python script, executable, in `folder`/bin."""
    script = folder / "bin" / "get-token"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!{sys.executable}\nimport json, os, subprocess, sys, time\n{body}\n")
    script.chmod(0o755)
    return script


def test_an_exec_plugin_is_run_with_its_arguments_and_env_and_its_credential_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin(
        tmp_path,
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "print(json.dumps({'kind': 'ExecCredential', 'status': {\n"
        "    'token': '-'.join([sys.argv[1], os.environ['CLUSTER'], info['apiVersion']]),\n"
        "    'expirationTimestamp': '2026-11-29T01:00:00Z'}}))",
    )
    exec_plugin = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "./bin/get-token",  # relative to the kubeconfig's folder, as kubectl has it
            "args": ["eks"],
            "env": [{"name": "CLUSTER", "value": "prod"}],
        }
    }
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", exec_plugin)))
    info = client.login(service_account=tmp_path / "no-sa")
    assert (info.server, info.token) == (
        "https://127.0.0.1:6443", "eks-prod-client.authentication.k8s.io/v1"
    )  # fmt: skip
    assert info.expiration == datetime.datetime(2026, 11, 29, 1, tzinfo=datetime.UTC)


@pytest.mark.timeout(30)
def test_an_exec_plugin_that_hangs_is_killed_at_its_deadline_with_what_it_started(
    tmp_path: Path,
) -> None:
    """The plugin hangs, and so does a child it started that holds its output open: waiting for
    that output to end would wait for ever, so the plugin's whole session is killed."""
    hangs = plugin(tmp_path, "subprocess.Popen(['sleep', '600'])\ntime.sleep(600)")
    with pytest.raises(logins.LoginFailed) as failed:
        logins.run_exec_plugin({"command": str(hangs)}, folder=tmp_path, timeout=0.5)
    assert str(failed.value) == "the exec plugin get-token did not answer within 0.5 s"


@pytest.mark.timeout(30)
def test_an_exec_plugin_that_prints_without_end_is_cut_off_at_the_cap_not_read_on(
    tmp_path: Path,
) -> None:
    """Its output is read to the cap and no further: the plugin is killed there, long before
    its deadline, and nothing past the cap is kept."""
    floods = plugin(tmp_path, "while True:\n    sys.stdout.write('x' * 65536)")
    with pytest.raises(logins.LoginFailed) as failed:
        logins.run_exec_plugin({"command": str(floods)}, folder=tmp_path, timeout=20)
    assert str(failed.value) == (
        f"the exec plugin get-token printed over {logins.MAX_EXEC_OUTPUT_BYTES} bytes"
    )


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            "print('token endpoint unreachable', file=sys.stderr); sys.exit(3)",
            "the exec plugin get-token exited with 3: token endpoint unreachable",
        ),
        (
            "print('Please log in at https://...')",
            "the exec plugin get-token printed no ExecCredential (not JSON)",
        ),
        (
            "print(json.dumps({'status': {'expirationTimestamp': '2026-11-29T01:00:00Z'}}))",
            "the exec plugin get-token printed neither a token nor a client certificate and key",
        ),
    ],
)
def test_an_exec_plugin_that_fails_says_how_and_kopf_gets_a_login_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, said: str
) -> None:
    command = plugin(tmp_path, body)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    user = {"exec": {"command": str(command)}}
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", user)))
    with pytest.raises(kopf.LoginError) as failed:
        client.login(service_account=tmp_path / "no-sa")
    assert str(failed.value) == said


def test_the_operator_command_keeps_the_kubernetes_client_out_whoever_logs_in(
    tmp_path: Path,
) -> None:
    """kopf imports the client's models whenever they are installed: 34 MiB (bench_scale). A
    legacy auth provider's login, the one use of them, runs in a child process."""
    probe = (
        "import sys; from batchpilot import cli; cli.keep_the_kubernetes_client_out();"
        " import kopf, batchpilot.handlers; print(sys.modules.get('kubernetes') is not None)"
    )
    provider = {"auth-provider": {"name": "oidc", "config": {}}}
    for user in ({"token": "t"}, {"exec": {"command": "gcloud"}}, provider):
        environment = {"KUBECONFIG": str(kubeconfig(tmp_path / "config", user))}
        printed = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
            env={**environment, "PATH": "/usr/bin:/bin"}, timeout=60,
        ).stdout.strip()  # fmt: skip
        assert printed == "False", (user, printed)


def id_token(expires: datetime.datetime) -> str:
    """An OIDC id-token as the Kubernetes client reads it: only its payload's `exp` counts."""

    def part(document: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(document).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none'})}.{part({'exp': int(expires.timestamp())})}.c2ln"


def oidc_user(token: str, issuer: str = "https://127.0.0.1:9/none") -> dict[str, Any]:
    config = {"id-token": token, "refresh-token": "r", "client-id": "k", "idp-issuer-url": issuer}
    return {"auth-provider": {"name": "oidc", "config": config}}


@pytest.mark.timeout(60)
def test_a_legacy_auth_provider_s_token_comes_from_the_client_in_a_child_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    valid = id_token(datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", oidc_user(valid))))
    assert logins.needs_the_client()
    info = client.login(service_account=tmp_path / "no-sa")
    assert (info.server, info.token) == ("https://127.0.0.1:6443", valid)


@pytest.mark.timeout(60)
def test_a_legacy_auth_provider_whose_issuer_never_answers_fails_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client refreshes an expired id-token from its issuer with no deadline of its own: an
    issuer that accepts the connection and never answers would hold the login for ever."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        issuer = f"http://127.0.0.1:{silent.getsockname()[1]}"
        expired = id_token(datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1))
        user = oidc_user(expired, issuer)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", user)))
        with pytest.raises(logins.LoginFailed) as failed:
            logins.kubeconfig_credential(timeout=3)
    assert str(failed.value) == (
        "the exec plugin for the auth provider oidc did not answer within 3 s"
    )


POLICY = {
    "apiVersion": "batchpilot.dev/v1alpha1",
    "kind": "BatchPolicy",
    "metadata": {"name": "desk", "namespace": "team-a", "uid": "u-1"},
}


def test_an_event_names_its_policy_and_batchpilot_as_its_source() -> None:
    now = datetime.datetime(2026, 11, 27, 9, 30, tzinfo=datetime.UTC)
    body = events.event_body(
        POLICY, now, type="Warning", reason="TargetUnreachable", message="x" * 2000
    )
    assert body["involvedObject"] == {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "name": "desk",
        "namespace": "team-a",
        "uid": "u-1",
    }
    assert body["metadata"] == {"namespace": "team-a", "generateName": "batchpilot-"}
    assert (body["type"], body["reason"]) == ("Warning", "TargetUnreachable")
    assert len(body["message"]) == events.MAX_MESSAGE_LENGTH
    assert body["source"] == {"component": "batchpilot"}
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2026-11-27T09:30:00+00:00"


async def test_an_event_that_cannot_be_posted_is_logged_not_raised(
    serve_app: ServeApp, caplog: pytest.LogCaptureFixture
) -> None:
    server = ApiServer((403, {"message": "events are forbidden"}))
    kube = logged_in(await serve_app(server.app()))
    await events.Events(kube).post(
        POLICY, type="Normal", reason="ProfileSwitched", message="bulk -> interactive"
    )
    await kube.close()
    assert [(seen["method"], seen["path"]) for seen in server.seen] == [
        ("POST", "/api/v1/namespaces/team-a/events")
    ]
    assert "event not posted (posting a ProfileSwitched event in team-a: Forbidden)" in caplog.text
