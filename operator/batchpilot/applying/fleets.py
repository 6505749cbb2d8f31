"""A fleet of Triton servers addressed by URL, with one client each, kept across ticks."""

from __future__ import annotations

import time
from collections.abc import Sequence

from batchpilot.applying import actuators, overrides
from batchpilot.policy import rendering
from batchpilot_triton import scraping, servers


class TritonFleet:
    """What the rollout needs from each Triton server, over its HTTP and metrics endpoints."""

    def __init__(self, *, request_timeout: float = 5.0, load_timeout: float = 300.0) -> None:
        self._servers: dict[str, servers.TritonServer] = {}
        self._request_timeout = request_timeout
        self._load_timeout = load_timeout

    def server(self, url: str) -> servers.TritonServer:
        if url not in self._servers:
            self._servers[url] = servers.TritonServer(
                url, request_timeout=self._request_timeout, load_timeout=self._load_timeout
            )
        return self._servers[url]

    async def forget_all_but(self, urls: Sequence[str]) -> None:
        """Close the clients of servers that are gone (a replaced Pod has a new IP)."""
        for url in set(self._servers) - set(urls):
            # Reconciles of several policies forget concurrently; the first one closes it.
            server = self._servers.pop(url, None)
            if server is not None:
                await server.close()

    async def close(self) -> None:
        await self.forget_all_but(())

    async def loaded_models(self, url: str) -> list[str]:
        return await self.server(url).loaded_models()

    async def runs(
        self, url: str, model: str, settings: rendering.Settings, *, profile: str
    ) -> bool:
        """Whether the model already runs the profile (raises ProfileRefused if it cannot)."""
        served = await self.server(url).model_config(model)
        wanted = overrides.merge(served, settings, profile=profile, model=model)
        return overrides.matches(served, wanted)

    async def pending_requests(self, url: str, models: Sequence[str]) -> float:
        page = await self.server(url).metrics_text()
        snapshot = scraping.parse(page, taken_at=time.monotonic())
        return sum(snapshot.pending(model) for model in models)

    async def apply(
        self,
        url: str,
        model: str,
        settings: rendering.Settings,
        *,
        profile: str,
        unload_first: bool,
        verify_timeout: float,
    ) -> actuators.Applied:
        return await actuators.apply_profile(
            self.server(url),
            model,
            settings,
            profile=profile,
            unload_first=unload_first,
            verify_timeout=verify_timeout,
        )
