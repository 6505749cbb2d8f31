"""The operator's one client for its own requests to the API server, with one error family.

kopf watches the policies and the Pods and keeps its own bookkeeping. Everything else the
operator asks of the API server — a Pod's readiness gate, a policy's status, an Event on a
policy, the one Secret a repository credential names — goes through `KubeClient`: aiohttp, as
kopf's own requests, logged in as kopf is (`login`: one login for both), one deadline on each
whole call (connecting, sending and the whole answer: an API server that answers a byte at a
time holds nothing past it), an answer read to a size cap, and one error, `KubeError`, whatever
failed (a refusal, a connection, no answer in time, an answer too large).

It uses no Kubernetes client library: that library's models cost the operator 34 MiB of
memory (`logins` says when the operator keeps it out: unless a kubeconfig's legacy auth
provider needs it to log in).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from batchpilot.kube import logins

logger = logging.getLogger("batchpilot.operator")

JSON = "application/json"
MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""The largest answer read: an object echoed back (a Secret is at most 1 MiB) and no more."""

SERVICE_ACCOUNT = logins.SERVICE_ACCOUNT


class KubeError(Exception):
    """A request the API server refused (`status` its HTTP status) or did not answer (`status`
    None: no connection, no answer in time, or an answer over the size cap)."""

    def __init__(self, what: str, status: int | None, reason: str) -> None:
        self.what = what
        self.status = status
        self.reason = reason
        super().__init__(f"{what}: {reason}")


def _in_cluster(service_account: Path) -> kopf.ConnectionInfo:
    """The Pod's ServiceAccount, at the address the kubelet gives every Pod (no cluster DNS
    needed), as the Kubernetes client's in-cluster configuration reads them."""
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ["KUBERNETES_SERVICE_PORT"]
    namespace = service_account / "namespace"
    ca = service_account / "ca.crt"
    return kopf.ConnectionInfo(
        server=f"https://{f'[{host}]' if ':' in host else host}:{port}",
        ca_path=str(ca) if ca.is_file() else None,
        token=(service_account / "token").read_text().strip() or None,
        default_namespace=namespace.read_text().strip() if namespace.is_file() else None,
    )


def login(
    *, logger: logging.Logger | kopf.Logger = logger, service_account: Path = SERVICE_ACCOUNT
) -> kopf.ConnectionInfo:
    """In a Pod its ServiceAccount, else the kubeconfig's current user (KUBECONFIG or
    ~/.kube/config), read afresh on each call (the kubelet rotates the token's file): its
    token or certificate, or what its exec plugin prints (run here, with a deadline:
    `logins.run_exec_plugin`). A legacy auth provider without a token is logged in by the
    Kubernetes client library in a child process, under the same deadline
    (`logins.kubeconfig_credential`)."""
    if logins.in_cluster(service_account):
        return _in_cluster(service_account)
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    if info is None:
        raise kopf.LoginError("no ServiceAccount token and no kubeconfig: cannot log in")
    try:
        credential = logins.kubeconfig_credential()
    except logins.LoginFailed as failed:
        raise kopf.LoginError(str(failed)) from None
    if credential is not None:
        info = dataclasses.replace(
            info,
            token=credential.token,
            certificate_data=credential.client_certificate_data,
            private_key_data=credential.client_key_data,
            expiration=credential.expiration,
        )
    return info


def _path(*segments: str) -> str:
    return "/" + "/".join(urllib.parse.quote(segment, safe="") for segment in segments)


def namespaced(api: str, namespace: str, plural: str, name: str = "", *sub: str) -> str:
    """`/api/v1/namespaces/ns/pods/name/status`-style paths, each segment quoted."""
    prefix = ("api", "v1") if api == "v1" else ("apis", *api.split("/"))
    return _path(*prefix, "namespaces", namespace, plural, *((name, *sub) if name else ()))


async def _read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The whole answer, or None if it runs past `cap` bytes (the rest is not read)."""
    answer = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        answer += chunk
        if len(answer) > cap:
            return None
    return bytes(answer)


LOGIN_SECONDS = 30.0
"""How long kopf's login waits (the client's own waits its call's deadline)."""

MAX_RUNNING_LOGINS = 2
"""Logins whose thread may still run at once: past it, a login fails at once, saying so."""

_running_logins = 0
_running_logins_lock = threading.Lock()


async def log_in(login: Callable[[], kopf.ConnectionInfo] = login) -> kopf.ConnectionInfo:
    """`login()` on a thread of its own, never on the event loop or its default pool; callers
    bound the wait (`asyncio.timeout`). Logging in reads files and may run a kubeconfig's exec
    plugin, or the Kubernetes client's auth provider in a child process, for up to
    `logins.EXEC_SECONDS`; but reading a kubeconfig has no deadline (a FIFO, a hung network
    mount), and a thread cannot be stopped. So each login has a daemon thread of its own: one
    that never returns holds only that thread (not the next login, nor the process's exit),
    and while `MAX_RUNNING_LOGINS` still run, the next login fails at once instead of adding
    another."""
    global _running_logins
    with _running_logins_lock:
        if _running_logins >= MAX_RUNNING_LOGINS:
            raise kopf.LoginError(
                f"{_running_logins} earlier logins have not returned (reading the kubeconfig or "
                "the ServiceAccount's files hangs?): not starting another"
            )
        _running_logins += 1
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[kopf.ConnectionInfo] = loop.create_future()

    def settle(result: kopf.ConnectionInfo | None, error: BaseException | None) -> None:
        if answer.done():  # the caller stopped waiting
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        global _running_logins
        result, error = None, None
        try:
            result = login()
        except BaseException as failed:  # handed to the caller, whatever it is
            error = failed
        finally:
            with _running_logins_lock:
                _running_logins -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="kube-login", daemon=True).start()
    return await answer


class KubeClient:
    """Requests to the API server, each bounded as a whole; logs in again once on a 401 (a
    rotated ServiceAccount token)."""

    def __init__(
        self,
        login: Callable[[], kopf.ConnectionInfo] = login,
        *,
        timeout: float = 10.0,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self._login = login
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes
        self._session: aiohttp.ClientSession | None = None

    async def _connect(self) -> aiohttp.ClientSession:
        info = await log_in(self._login)  # within the call's deadline (`_exchange`)
        return aiohttp.ClientSession(
            base_url=info.server,
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context(), limit=8),
            headers=info.as_http_headers(),
            # Each call is bounded as a whole by `request`; no proxy from the environment.
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
        )

    async def request(
        self,
        what: str,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        """The API server's answer to `method path` (JSON), or KubeError."""
        exchange = (what, method, path, body, content_type)
        status, reason, answer = await self._exchange(*exchange)
        if status == 401:  # a rotated token: log in again, once
            await self.close()
            status, reason, answer = await self._exchange(*exchange)
        if status >= 400:
            raise KubeError(what, status, reason or f"HTTP {status}")
        try:
            found = json.loads(answer) if answer else {}
        except ValueError:
            raise KubeError(what, None, "an answer that is not JSON") from None
        return found if isinstance(found, dict) else {}

    async def _exchange(
        self,
        what: str,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        content_type: str,
    ) -> tuple[int, str | None, bytes]:
        data = None if body is None else json.dumps(body).encode()
        try:
            async with asyncio.timeout(self.timeout):
                if self._session is None or self._session.closed:
                    self._session = await self._connect()
                headers = {"Content-Type": content_type, "Accept": JSON}
                async with self._session.request(
                    method, path, data=data, headers=headers
                ) as response:
                    answer = await _read_capped(response, self.max_answer_bytes)
                    if answer is None:
                        raise KubeError(what, None, f"an answer over {self.max_answer_bytes} bytes")
                    return response.status, response.reason, answer
        except TimeoutError:
            raise KubeError(what, None, "no answer in time") from None
        except (aiohttp.ClientError, OSError) as error:
            raise KubeError(what, None, f"no connection ({type(error).__name__})") from None
        except kopf.LoginError as error:
            raise KubeError(what, None, f"cannot log in ({error})") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
