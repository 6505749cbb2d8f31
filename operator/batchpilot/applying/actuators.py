"""Applying a profile to one model on one Triton server, safely.

The sequence is level-based and idempotent, so callers can run it every tick:

1. read the served configuration; refuse a profile the model cannot take (nothing changes);
2. if the served configuration already matches, stop: no reload, no stall;
3. optionally unload first, so a GPU never holds two copies of the model: Triton answers an
   unload at once and ends the old instances in the background (its index says UNLOADING), so
   the load waits until the index says they are gone;
4. load with the merged configuration as an override;
5. verify: the server reports the new configuration and the model is ready;
6. if the load or the verification fails, load the previous configuration again and report.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from batchpilot.applying import overrides
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs, servers

_VERIFY_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class Applied:
    """The outcome of a successful apply."""

    model: str
    profile: str
    previous_profile: str | None
    reloaded: bool
    """False when the server already ran the profile: nothing was sent."""
    seconds: float


class ApplyFailed(servers.TritonError):
    """The new configuration did not take; `rolled_back` says whether the old one serves."""

    def __init__(self, url: str, message: str, *, rolled_back: bool) -> None:
        self.rolled_back = rolled_back
        suffix = "previous configuration restored" if rolled_back else "ROLLBACK FAILED"
        super().__init__(url, f"{message}; {suffix}")


async def apply_profile(
    server: servers.TritonServer,
    model: str,
    settings: rendering.Settings,
    *,
    profile: str,
    unload_first: bool = False,
    verify_timeout: float = 120.0,
) -> Applied:
    """Make `model` on `server` run `profile`; raises ProfileRefused, ApplyFailed or TritonError."""
    clock = asyncio.get_running_loop().time
    started = clock()
    served = await server.model_config(model)
    wanted = overrides.merge(served, settings, profile=profile, model=model)
    previous_profile = modelconfigs.applied_profile(served)
    if overrides.matches(served, wanted):
        return Applied(model, profile, previous_profile, False, clock() - started)

    try:
        if unload_first:
            await server.unload(model)
            await _unloaded(server, model, within=verify_timeout)
        await server.load(model, wanted.config)
        await _verify(server, model, wanted, within=verify_timeout)
    except (servers.LoadRejected, _NotVerified) as error:
        rolled_back = await _restore(server, model, served, within=verify_timeout)
        raise ApplyFailed(
            server.url, f"applying {profile} to {model} failed: {error}", rolled_back=rolled_back
        ) from None
    return Applied(model, profile, previous_profile, True, clock() - started)


class _NotVerified(Exception):
    pass


async def _verify(
    server: servers.TritonServer, model: str, wanted: overrides.Override, *, within: float
) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            if await server.model_ready(model) and overrides.matches(
                await server.model_config(model), wanted
            ):
                return
        except servers.ModelUnavailable:
            pass  # still loading
        if asyncio.get_running_loop().time() >= deadline:
            raise _NotVerified(f"the server did not report the new configuration in {within:g}s")
        await asyncio.sleep(_VERIFY_POLL_SECONDS)


async def _unloaded(server: servers.TritonServer, model: str, *, within: float) -> None:
    """Wait until none of the model's instances is still being unloaded."""
    deadline = asyncio.get_running_loop().time() + within
    while "UNLOADING" in await server.model_states(model):
        if asyncio.get_running_loop().time() >= deadline:
            raise _NotVerified(f"the old instances were still unloading after {within:g}s")
        await asyncio.sleep(_VERIFY_POLL_SECONDS)


async def _restore(
    server: servers.TritonServer,
    model: str,
    previous: modelconfigs.ModelConfig,
    *,
    within: float,
) -> bool:
    """Load the previous configuration again; True once the server serves it."""
    try:
        await server.load(model, previous)
        await _verify(
            server,
            model,
            overrides.Override(previous, modelconfigs.applied_profile(previous) or ""),
            within=within,
        )
    except (servers.TritonError, _NotVerified):
        return False
    return True
