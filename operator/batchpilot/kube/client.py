"""The operator's one client for its own requests to the API server, with one error family.

kopf watches the policies and the Pods and keeps its own bookkeeping. Everything else the
operator asks of the API server — a Pod's readiness gate, a policy's status, an Event on a
policy, the one Secret a repository credential names — goes through `KubeClient`: the Kubernetes
client that kopf logs in with too (`handlers.login`), one deadline on each whole call, and one
error, `KubeError`, whatever failed (a refusal, a connection, no answer in time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
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


WORKERS = 4
"""Threads for calls to the API server at once: beyond them, calls queue (and time out)."""


class KubeClient:
    """The synchronous Kubernetes client, called from worker threads of its own with a deadline.

    The deadline ends the wait, not the call: a request an API server answers a byte at a time
    keeps its thread. On a pool of their own such calls can only hold these threads, never the
    event loop's default pool, which name resolution for every Triton request uses too.
    """

    def __init__(
        self, api: kubernetes.client.ApiClient, *, timeout: float = 10.0, workers: int = WORKERS
    ) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.timeout = timeout
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kube-client"
        )

    async def call(self, what: str, method: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
        """`method(*args, **kw)`: its answer, or KubeError. The client's `_request_timeout`
        bounds each socket read, not the call, so the wait is bounded too (twice that)."""
        request = functools.partial(method, *args, _request_timeout=self.timeout, **kw)
        try:
            async with asyncio.timeout(self.timeout * 2):
                return await asyncio.get_running_loop().run_in_executor(self._threads, request)
        except kubernetes.client.ApiException as error:
            raise KubeError(what, error.status, error.reason or f"HTTP {error.status}") from None
        except TimeoutError:
            raise KubeError(what, None, "no answer in time") from None
        except urllib3.exceptions.HTTPError as error:
            raise KubeError(what, None, f"no connection ({type(error).__name__})") from None

    def close(self) -> None:
        """Lets the threads go once their calls end; queued calls are dropped."""
        self._threads.shutdown(wait=False, cancel_futures=True)
