"""A fleet of Triton servers addressed by URL: one client each, kept across ticks and shared by
every policy, closed once no policy governs its server, and left alone for a while after it
stopped answering (exponential backoff), so a dead replica costs neither a timeout per tick nor
anyone else's rollout."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from batchpilot.applying import actuators, backoffs, engines
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_triton import responses, servers

Answer = TypeVar("Answer")


@dataclass(frozen=True)
class QueueReading:
    pending: float
    """Requests queued, not yet executing."""
    completed: float
    """Requests completed (succeeded or failed) since the server started counting."""


class TritonFleet:
    """What the rollout needs from each Triton server, over its HTTP and metrics endpoints."""

    def __init__(
        self,
        *,
        request_timeout: float = responses.TRITON_DEADLINE_SECONDS,
        load_timeout: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        engine_arguments: engines.EngineArgumentsSource | None = None,
    ) -> None:
        self._servers: dict[str, servers.TritonServer] = {}
        self._engine_arguments = engine_arguments
        """Where LLM models' repository `model.json` is read; None: LLM profiles are refused."""
        self._request_timeout = request_timeout
        self._load_timeout = load_timeout
        self._clock = clock
        self._backoffs: dict[str, tuple[backoffs.Backoff, str]] = {}
        self._holders: dict[Hashable, frozenset[str]] = {}
        self._repository_headers: dict[str, dict[str, str]] = {}
        """Per URL, the credential its holder sends on model-repository calls."""

    def server(self, url: str) -> servers.TritonServer:
        if url not in self._servers:
            self._servers[url] = servers.TritonServer(
                url,
                request_timeout=self._request_timeout,
                load_timeout=self._load_timeout,
                repository_headers=self._repository_headers.get(url),
            )
        return self._servers[url]

    def adopt(self, server: servers.TritonServer) -> None:
        """Use this client for its URL (the runner's servers carry their own metrics URLs)."""
        self._servers[server.url] = server

    async def hold(
        self,
        holder: Hashable,
        urls: Collection[str],
        *,
        repository_headers: Mapping[str, str] | None = None,
    ) -> None:
        """`holder` (a policy) governs these servers now, with this credential for their
        model-repository calls: clients nobody holds are closed."""
        self._holders[holder] = frozenset(urls)
        for url in urls:
            self._repository_headers[url] = dict(repository_headers or {})
            if url in self._servers:
                self._servers[url].repository_headers = dict(repository_headers or {})
        await self._close_unheld()

    async def release(self, holder: Hashable) -> None:
        """`holder` is gone: it keeps no client open any more."""
        self._holders.pop(holder, None)
        await self._close_unheld()

    async def close(self) -> None:
        self._holders.clear()
        await self._close_unheld()

    async def _close_unheld(self) -> None:
        held = frozenset().union(*self._holders.values())
        for url in set(self._servers) - held:
            # Several policies may release at once; the first one closes the client.
            server = self._servers.pop(url, None)
            self._backoffs.pop(url, None)
            self._repository_headers.pop(url, None)
            if server is not None:
                await server.close()

    async def _ask(
        self, url: str, question: Callable[[servers.TritonServer], Awaitable[Answer]]
    ) -> Answer:
        """Ask a server, unless it is backing off; an unreachable one starts backing off."""
        if url in self._backoffs:
            backoff, message = self._backoffs[url]
            waiting = backoff.waiting(self._clock())
            if waiting > 0:
                raise backoffs.BackingOff(url, message, retry_in=waiting)
        try:
            answer = await question(self.server(url))
        except servers.Unreachable as error:
            backoff = self._backoffs.get(url, (backoffs.Backoff(), ""))[0]
            backoff.failed(self._clock())
            self._backoffs[url] = (backoff, error.message)
            raise
        self._backoffs.pop(url, None)
        return answer

    async def loaded_models(self, url: str) -> list[str]:
        return await self._ask(url, lambda server: server.loaded_models())

    async def runs(
        self, url: str, model: str, settings: rendering.Settings, *, profile: str
    ) -> bool:
        """Whether the model already runs the profile (raises ProfileRefused if it cannot)."""
        served = await self._ask(url, lambda server: server.model_config(model))
        return actuators.runs(served, settings, profile=profile, model=model)

    async def queue(self, url: str, models: Sequence[str]) -> QueueReading:
        """The models' queued requests and how many requests they have completed so far. The
        metrics page is another endpoint than the model API: a failure to read it (a drain cut
        short) starts no backoff, which would hold up the switch that follows the drain."""
        snapshot = await self.server(url).metrics_snapshot(self._clock)
        return QueueReading(
            pending=sum(snapshot.pending(model) for model in models),
            completed=sum(snapshot.totals(model).requests for model in models),
        )

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
        return await self._ask(
            replica.http_url,
            lambda server: actuators.apply_profile(
                server,
                model,
                settings,
                profile=profile,
                unload_first=unload_first,
                verify_timeout=verify_timeout,
                engine_arguments=self._engine_arguments,
                replica=replica,
            ),
        )
