"""The operator's one client for its own requests to the API server, with one error family.

kopf watches the policies and the Pods and keeps its own bookkeeping. Everything else the
operator asks of the API server — a Pod's readiness gate, a policy's status, an Event on a
policy, the one Secret a repository credential names — goes through `KubeClient`: the Kubernetes
client that kopf logs in with too (`handlers.login`), one deadline on each whole call, and one
error, `KubeError`, whatever failed (a refusal, a connection, no answer in time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions


class KubeError(Exception):
    """A request the API server refused (`status` its HTTP status) or did not answer (`status`
    None: no connection, or no answer in time)."""

    def __init__(self, what: str, status: int | None, reason: str) -> None:
        self.what = what
        self.status = status
        self.reason = reason
        super().__init__(f"{what}: {reason}")


def load_configuration() -> None:
    """In-cluster credentials when running in a Pod, else the kubeconfig (as kopf does)."""
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]


class KubeClient:
    """The synchronous Kubernetes client, called from worker threads with a deadline."""

    def __init__(self, api: kubernetes.client.ApiClient, *, timeout: float = 10.0) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.timeout = timeout

    async def call(self, what: str, method: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
        """`method(*args, **kw)`: its answer, or KubeError. The client's `_request_timeout`
        bounds each socket read, not the call, so the wait is bounded too (twice that)."""
        try:
            async with asyncio.timeout(self.timeout * 2):
                return await asyncio.to_thread(method, *args, _request_timeout=self.timeout, **kw)
        except kubernetes.client.ApiException as error:
            raise KubeError(what, error.status, error.reason or f"HTTP {error.status}") from None
        except TimeoutError:
            raise KubeError(what, None, "no answer in time") from None
        except urllib3.exceptions.HTTPError as error:
            raise KubeError(what, None, f"no connection ({type(error).__name__})") from None
