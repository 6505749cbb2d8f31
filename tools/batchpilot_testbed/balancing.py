"""The endpoint-aware client: each request to a random Ready Pod, chosen when it is sent.

A Service (kube-proxy) routes connections, and clients that keep theirs (HTTP keep-alive, gRPC
channels) stay on the Pod they reached first (`batchpilot_testbed.clients`). A service mesh, a gRPC
xDS client or
a headless Service with client-side balancing routes each request instead. This is that client:
a thread lists the namespace's Pods a few times a second and keeps the Ready ones, and every
request goes to one of those. A Pod whose readiness gate goes False stops getting new requests
within one poll. The thread also records each Pod's gate history, which tests read. Used by the
operator e2e tests and the benchmarks.
"""

import asyncio
import contextlib
import random
import threading
import types
from collections.abc import Sequence
from typing import Self

from batchpilot.kube import pods
from batchpilot_harness import loadgen
from batchpilot_testbed import fleet
from batchpilot_testbed.kubes import Kube

POLL_SECONDS = 0.05


class ReadyBalancer:
    """Sends each request to a random Ready pod of `ips` (pod name -> IP); a context manager
    that watches readiness while it is entered."""

    def __init__(
        self, kube: Kube, namespace: str, ips: dict[str, str], *, poll: float = POLL_SECONDS
    ) -> None:
        self.kube, self.namespace, self.ips = kube, namespace, ips
        self.poll = poll
        self.ready: list[str] = list(ips.values())
        self.gate_history: dict[str, list[str]] = {pod: [] for pod in ips}
        self.started = 0.0
        """When the last `drive` began (`time.monotonic()`); record times count from it."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # an API hiccup keeps the last view
                self._observe()
            self._stop.wait(self.poll)

    def _observe(self) -> None:
        ready = []
        for pod in self.kube.core.list_namespaced_pod(self.namespace).items:
            name = pod.metadata.name if pod.metadata else None
            if name not in self.ips:
                continue
            listed = pod.status.conditions if pod.status else None
            conditions = {c.type: c.status for c in listed or []}
            if conditions.get("Ready") == "True":
                ready.append(self.ips[name])
            gate = conditions.get(pods.GATE, "unset")
            history = self.gate_history[name]
            if not history or history[-1] != gate:
                history.append(gate)
        self.ready = ready

    async def drive(
        self,
        phases: Sequence[loadgen.Phase],
        *,
        model: str = fleet.MODEL,
        seed: int = 0,
        request_timeout: float = 10.0,
    ) -> list[loadgen.RequestRecord]:
        """Open-loop Poisson arrivals over `phases` (`loadgen.run_load`), each sent to a Ready
        pod when it is due; one record per arrival (not sent: no pod was Ready). Times are
        seconds after `self.started`, a `time.monotonic()` reading."""
        payload = loadgen.InferencePayload.for_input(
            model=model, input_name="INPUT", datatype="FP32", shape=[1, 16]
        )
        chooser = random.Random(seed)

        def ready_pod() -> str | None:
            ready = self.ready
            return fleet.triton_url(chooser.choice(ready)) if ready else None

        # asyncio's loop clock is time.monotonic(), which the callers compare `started` with.
        self.started = asyncio.get_running_loop().time()
        result = await loadgen.run_load(
            base_url=ready_pod,
            payload=payload,
            phases=phases,
            seed=seed,
            request_timeout=request_timeout,
            start=self.started,
        )
        return list(result.records)
