"""Fakes at the operator's two boundaries: the Kubernetes API (Pods, gates) and Triton servers.

They record what the code under test asked for, in order, so tests can assert on the sequence
(gate closed, drained, applied, gate opened) as well as the outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from batchpilot.applying import actuators, backoffs, fleets, overrides
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering, specs
from batchpilot_triton import servers


def target(name: str, *, gated: bool = False, gate: str | None = None, ip: str = "") -> Replica:
    """A Pod's replica, as the operator finds it."""
    number = int(name.rsplit("-", 1)[-1]) if name[-1].isdigit() else 0
    return Replica(
        name=name,
        http_url=f"http://{ip or f'10.88.0.{number + 1}'}:8000",
        gated=gated,
        gate=gate,
        kind="pod",
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
        return server.profile == profile

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
            await asyncio.sleep(self.apply_seconds)
            if server.fail_with is not None:
                raise server.fail_with
            previous, server.profile = server.profile, profile
            return actuators.Applied(model, profile, previous, True, self.apply_seconds)
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

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        self.changes.append((pod, applied, reason))
        if self.fleet is not None:
            self.fleet.calls.append(("gate-" + ("open" if applied else "close"), pod))


class FakePods:
    def __init__(self, targets: list[Replica], skipped: list[str] | None = None) -> None:
        self.found = targets
        self.skipped = skipped or []

    async def replicas(
        self, namespace: str, target_spec: specs.Target
    ) -> tuple[list[Replica], list[str]]:
        return list(self.found), list(self.skipped)
