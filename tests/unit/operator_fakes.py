"""Fakes at the operator's two boundaries: the Kubernetes API (Pods, gates) and Triton servers.

They record what the code under test asked for, in order, so tests can assert on the sequence
(gate closed, drained, applied, gate opened) as well as the outcome.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, backoffs, fleets, overrides
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs, repositories, servers


def target(
    name: str,
    *,
    gated: bool = False,
    gate: str | None = None,
    ip: str = "",
    node: str | None = None,
) -> Replica:
    """A Pod's replica, as the operator finds it."""
    number = int(name.rsplit("-", 1)[-1]) if name[-1].isdigit() else 0
    return Replica(
        name=name,
        http_url=f"http://{ip or f'10.88.0.{number + 1}'}:8000",
        gated=gated,
        gate=gate,
        kind="pod",
        node=node,
    )


@dataclass
class FakeServer:
    models: list[str] = field(default_factory=lambda: ["gpu_sim"])
    profile: str | None = None
    pending: list[float] = field(default_factory=list)
    """Pending-request readings to return in turn (then 0)."""
    completed: list[float] = field(default_factory=list)
    """Completed-request counts to return in turn (then the last one)."""
    fail_with: Exception | None = None
    refuse: str | None = None
    unreachable: bool = False
    repository_headers: dict[str, str] | None = None
    """The credential its repository API is locked to (None: open)."""
    settings: rendering.Settings | None = None
    """The settings it was last given (None: whatever its profile's were, for a server a test
    starts on a profile)."""
    apply_seconds: float | None = None
    """How long a reload takes on it (None: the fleet's `apply_seconds`)."""


class FakeFleet:
    def __init__(self, servers_by_url: dict[str, FakeServer]) -> None:
        self.servers = servers_by_url
        self.calls: list[tuple[str, str]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.apply_seconds = 0.0
        self.backing_off = False
        """Unreachable servers answer as the real fleet's do while backing off."""
        self.held: dict[object, list[str]] = {}
        """The servers each holder (policy) governs, as last told."""
        self.headers: dict[str, dict[str, str]] = {}
        """The repository credential sent to each server, as its holder last gave it."""

    def _server(self, url: str) -> FakeServer:
        server = self.servers[url]
        if server.unreachable and self.backing_off:
            raise backoffs.BackingOff(url, "connection refused", retry_in=4.0)
        if server.unreachable:
            raise servers.Unreachable(url, "connection refused")
        return server

    async def loaded_models(self, url: str) -> list[str]:
        server = self._server(url)
        locked = server.repository_headers
        if locked is not None and self.headers.get(url) != locked:
            raise servers.RepositoryLocked(url, "model index: the server refused the credential")
        return list(server.models)

    async def runs(
        self, url: str, model: str, settings: rendering.Settings, *, profile: str
    ) -> bool:
        server = self._server(url)
        if server.refuse:
            raise overrides.ProfileRefused(server.refuse)
        return server.profile == profile and server.settings in (None, settings)

    async def queue(self, url: str, models: Sequence[str]) -> fleets.QueueReading:
        server = self._server(url)
        self.calls.append(("pending", url))
        pending = server.pending.pop(0) if server.pending else 0.0
        completed = server.completed.pop(0) if len(server.completed) > 1 else 0.0
        if len(server.completed) == 1:
            completed = server.completed[0]
        return fleets.QueueReading(pending=pending, completed=completed)

    async def apply(
        self,
        replica: Replica,
        model: str,
        settings: rendering.Settings,
        *,
        profile: str,
        unload_first: bool,
        verify_timeout: float,
    ) -> actuators.Applied:
        server = self._server(replica.http_url)
        self.calls.append(("apply", replica.http_url))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            seconds = self.apply_seconds if server.apply_seconds is None else server.apply_seconds
            await asyncio.sleep(seconds)
            if server.fail_with is not None:
                raise server.fail_with
            previous, server.profile, server.settings = server.profile, profile, settings
            return actuators.Applied(model, profile, previous, True, seconds)
        finally:
            self.in_flight -= 1

    def server(self, url: str) -> servers.TritonServer:
        return servers.TritonServer(url)

    async def hold(
        self,
        holder: object,
        urls: Sequence[str],
        *,
        repository_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.held[holder] = sorted(urls)
        self.headers.update({url: dict(repository_headers or {}) for url in urls})

    async def release(self, holder: object) -> None:
        self.held.pop(holder, None)

    async def close(self) -> None:
        self.held.clear()


class FakeGates:
    def __init__(self, fleet: FakeFleet | None = None) -> None:
        self.fleet = fleet
        self.changes: list[tuple[str, bool, str]] = []
        self.messages: list[str] = []
        self.fail: dict[bool, BaseException] = {}
        """The API error a write of the gate to True (or False) raises, once."""
        self.never_ready: set[str] = set()
        """Pods that are not Ready however long a rollout waits (the others are at once)."""
        self.waits: list[list[str]] = []

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        if applied in self.fail:
            raise self.fail.pop(applied)
        self.changes.append((pod, applied, reason))
        self.messages.append(message)
        if self.fleet is not None:
            self.fleet.calls.append(("gate-" + ("open" if applied else "close"), pod))

    async def wait_ready(self, namespace: str, pods: Sequence[str], *, within: float) -> list[str]:
        self.waits.append(list(pods))
        if self.fleet is not None:
            self.fleet.calls.extend(("wait-ready", pod) for pod in pods)
        late = sorted(set(pods) & self.never_ready)
        if late:
            await asyncio.sleep(within)
        return late


class FakePods:
    def __init__(self, targets: list[Replica], skipped: list[str] | None = None) -> None:
        self.found = targets
        self.skipped = skipped or []

    async def replicas(
        self, namespace: str, target_spec: specs.Target
    ) -> tuple[list[Replica], list[str]]:
        return list(self.found), list(self.skipped)


SWITCH_STEPS = (
    "survey",
    "check",
    "drain",
    "read-config",
    "unload",
    "unloading",
    "load",
    "load-answer-lost",
    "verify-ready",
    "verify-config",
)
"""The calls a gated switch with unloadBeforeLoad makes to Triton, in order; a fault at
`load-answer-lost` strikes after the server took the load. The survey and the check come
before the gate closes."""


LLM_SWITCH_STEPS = (*SWITCH_STEPS[:4], "engine-arguments", *SWITCH_STEPS[4:])
"""The same for a model served by vLLM: its repository's model.json is read (from the sidecar,
in a cluster) after the served configuration."""


class ScriptedTriton(servers.TritonServer):
    """One Triton server serving one model as Triton does (a load replaces its configuration, an
    unload leaves it UNLOADING for a look, then gone), with dynamic batching or served by vLLM or
    TensorRT-LLM (`backend`); with a fault injected at one step of a switch: raised once, or,
    `sticky`, at every call from then on (a server that broke for good)."""

    def __init__(
        self,
        url: str,
        *,
        fault_at: str | None = None,
        fault: BaseException | None = None,
        sticky: bool = False,
        backend: str = "python",
    ) -> None:
        super().__init__(url)
        self.repository_config: dict[str, Any] = {
            "vllm": {"name": "gpu_sim", "backend": "vllm", "max_batch_size": 0, "parameters": {}},
            "tensorrtllm": {
                "name": "gpu_sim",
                "backend": "tensorrtllm",
                "max_batch_size": 64,
                "parameters": {
                    "gpt_model_type": {"string_value": "inflight_fused_batching"},
                    "batch_scheduler_policy": {"string_value": "guaranteed_no_evict"},
                },
            },
        }.get(
            backend,
            {
                "name": "gpu_sim",
                "backend": backend,
                "max_batch_size": 32,
                "dynamic_batching": {
                    "max_queue_delay_microseconds": 100,
                    "preferred_batch_size": [32],
                },
                "parameters": {},
            },
        )
        self.model_json: dict[str, Any] = {"model": "/models/tiny", "max_num_seqs": 16}
        """The repository's model.json (a vLLM model's engine arguments)."""
        self.loaded_files: Mapping[str, bytes] = {}
        """The file overrides of the last load."""
        self.served: dict[str, Any] | None = copy.deepcopy(self.repository_config)
        """The configuration it serves; None once unloaded."""
        self.unloading = False
        self.fault_at = fault_at
        self.fault = fault
        self.sticky = sticky
        self.broken = False
        self.config_reads = 0

    def _step(self, step: str) -> None:
        if self.broken or step == self.fault_at:
            self.broken = self.sticky
            self.fault_at = None
            assert self.fault is not None
            raise self.fault

    async def metrics_text(self) -> str:
        self._step("drain")
        return ""

    async def loaded_models(self) -> list[str]:
        self._step("survey")
        return ["gpu_sim"] if self.served is not None else []

    async def model_config(self, model: str) -> modelconfigs.ModelConfig:
        self.config_reads += 1
        reads = {1: "check", 2: "read-config"}
        self._step(reads.get(self.config_reads, "verify-config"))
        if self.served is None:
            raise servers.ModelUnavailable(self.url, f"config of {model}: unknown model")
        return copy.deepcopy(self.served)

    async def model_ready(self, model: str) -> bool:
        self._step("verify-ready")
        return self.served is not None

    async def repository_index(self) -> list[dict[str, Any]]:
        self._step("unloading")
        state = "UNLOADING" if self.unloading else ("READY" if self.served else "UNAVAILABLE")
        self.unloading = False
        return [{"name": "gpu_sim", "state": state}]

    async def unload(self, model: str) -> None:
        self._step("unload")
        self.served, self.unloading = None, True

    async def load(
        self,
        model: str,
        config: modelconfigs.ModelConfig | None = None,
        *,
        files: Mapping[str, bytes] | None = None,
    ) -> None:
        self._step("load")
        self.served = copy.deepcopy(config or self.repository_config)
        self.loaded_files = dict(files or {})
        self._step("load-answer-lost")

    async def repository_arguments(
        self, replica: Replica, model: str
    ) -> repositories.RepositoryArguments:
        """As the sidecar beside it serves them: it is the `EngineArgumentsSource` too."""
        self._step("engine-arguments")
        return repositories.RepositoryArguments("1", dict(self.model_json))

    @property
    def profile(self) -> str | None:
        return None if self.served is None else modelconfigs.applied_profile(self.served)
