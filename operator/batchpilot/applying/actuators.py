"""Applying a profile to one model on one Triton server, safely.

The sequence is level-based and idempotent, so callers can run it every tick:

1. read the served configuration; refuse a profile the model cannot take (nothing changes;
   anything else that breaks here changes nothing either, and says so: `NotApplied`);
2. if the served configuration already matches, stop: no reload, no stall;
3. optionally unload first, so a GPU never holds two copies of the model: Triton answers an
   unload at once and ends the old instances in the background (its index says UNLOADING), so
   the load waits until the index says they are gone;
4. load with the merged configuration as an override;
5. verify: the server reports the new configuration and the model is ready;
6. if anything breaks once a change began (an unload, a load, the verification; a rejection,
   a server gone quiet, an answer nobody expected), load the previous configuration again and
   report whether it serves (`ApplyFailed`). The caller that owns the readiness gate decides
   from that alone whether the Pod may take requests again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from batchpilot.applying import engines, overrides, replicas
from batchpilot.applying.replicas import Replica
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
    notes: tuple[str, ...] = ()
    """What was wrong with the served configuration and set right (or left) on the way."""


class NotApplied(servers.TritonError):
    """Applying broke before anything was sent to the server: it serves what it served."""


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
    engine_arguments: engines.EngineArgumentsSource | None = None,
    replica: Replica | None = None,
) -> Applied:
    """Make `model` on `server` run `profile`.

    Raises ProfileRefused, NotApplied or ExplicitModeRequired when nothing was changed (the
    server serves what it served), ApplyFailed once a change began (whether the previous
    configuration serves again), or Unreachable and ModelUnavailable when the model could not
    even be read. A model served by vLLM takes the profile's `llm` settings in its
    `model.json`, built on the repository's, which `engine_arguments` reads for `replica`
    (default: the server, named by its URL); one served by TensorRT-LLM takes them as config
    parameters."""
    clock = asyncio.get_running_loop().time
    started = clock()
    try:
        served = await server.model_config(model)
        change = await _planned(server, model, served, settings, profile, engine_arguments, replica)
    except (overrides.ProfileRefused, servers.Unreachable, servers.ModelUnavailable):
        raise
    except Exception as error:
        # Nothing was sent: whatever went wrong (a malformed file, an odd answer), the server
        # serves what it served.
        raise NotApplied(
            server.url, f"applying {profile} to {model}: {_described(error)}"
        ) from error
    previous_profile = modelconfigs.applied_profile(served)
    if change is None:
        return Applied(model, profile, previous_profile, False, clock() - started, _notes(served))
    wanted, base = change
    sent = False
    try:
        if unload_first:
            await server.unload(model)
            sent = True
            await _unloaded(server, model, within=verify_timeout)
        await server.load(model, wanted.config, files=wanted.files)
        sent = True
        await _verify(server, model, wanted, within=verify_timeout)
    except (servers.ExplicitModeRequired, servers.RepositoryLocked) as error:
        if not sent:
            raise  # refused before anything changed
        raise ApplyFailed(
            server.url,
            f"applying {profile} to {model} failed: {error.message}",
            rolled_back=await _restore(server, model, served, base, within=verify_timeout),
        ) from error
    except Exception as error:
        # Whatever broke the change (a rejected load, a server gone quiet mid-load with the
        # model unloaded, an answer nobody expected), the previous configuration is loaded
        # again before anyone hears of it.
        rolled_back = await _restore(server, model, served, base, within=verify_timeout)
        raise ApplyFailed(
            server.url,
            f"applying {profile} to {model} failed: {_described(error)}",
            rolled_back=rolled_back,
        ) from error
    return Applied(model, profile, previous_profile, True, clock() - started, _notes(served))


async def _planned(
    server: servers.TritonServer,
    model: str,
    served: modelconfigs.ModelConfig,
    settings: rendering.Settings,
    profile: str,
    engine_arguments: engines.EngineArgumentsSource | None,
    replica: Replica | None,
) -> tuple[overrides.Override, engines.RepositoryArguments | None] | None:
    """The load request that makes the model run the profile, and the repository's engine
    arguments it is built on; None when the server runs the profile already."""
    if engines.is_llm_engine(served):
        if engines.runs(served, settings, profile=profile, model=model):
            return None
        if engine_arguments is None:
            raise engines.EngineArgumentsUnavailable(
                f"model {model!r} is served by Triton's vLLM backend: setting its engine "
                "arguments needs its repository's model.json, and none was given to read it from"
            )
        base = await engine_arguments.repository_arguments(
            replica or replicas.from_url(server.url), model
        )
        return engines.merge(served, base, settings, profile=profile, model=model), base
    wanted = _merge(served, settings, profile=profile, model=model)
    return None if _matches(served, wanted) else (wanted, None)


def _described(error: BaseException) -> str:
    if isinstance(error, servers.TritonError):
        return error.message
    if isinstance(error, _NotVerified):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _notes(served: modelconfigs.ModelConfig) -> tuple[str, ...]:
    return tuple(
        f"ignored its malformed config parameter {problem}"
        for problem in modelconfigs.malformed_parameters(served)
    )


def runs(
    served: modelconfigs.ModelConfig, settings: rendering.Settings, *, profile: str, model: str
) -> bool:
    """Whether a served model already runs the profile (raises ProfileRefused if it cannot)."""
    if engines.is_llm_engine(served):
        return engines.runs(served, settings, profile=profile, model=model)
    return _matches(served, _merge(served, settings, profile=profile, model=model))


def _merge(
    served: modelconfigs.ModelConfig, settings: rendering.Settings, *, profile: str, model: str
) -> overrides.Override:
    """The config-only load request of a profile: TensorRT-LLM parameters, or dynamic batching."""
    if engines.is_tensorrt_llm(served):
        return engines.merge_parameters(served, settings, profile=profile, model=model)
    return overrides.merge(served, settings, profile=profile, model=model)


def _matches(served: modelconfigs.ModelConfig, wanted: overrides.Override) -> bool:
    if engines.is_llm_engine(wanted.config):
        return engines.matches(served, wanted)
    if engines.is_tensorrt_llm(wanted.config):
        return engines.parameters_match(served, wanted)
    return overrides.matches(served, wanted)


class _NotVerified(Exception):
    pass


async def _verify(
    server: servers.TritonServer, model: str, wanted: overrides.Override, *, within: float
) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            if await server.model_ready(model) and _matches(
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
    served: modelconfigs.ModelConfig,
    base: engines.RepositoryArguments | None,
    *,
    within: float,
) -> bool:
    """Load the configuration the server served before the change again; True once the server
    serves it. Never raises: a rollback that breaks is a rollback that failed."""
    try:
        previous = (
            overrides.Override(served, modelconfigs.applied_profile(served) or "")
            if base is None
            else engines.restoring(served, base)
        )
        await server.load(model, previous.config, files=previous.files)
        await _verify(server, model, previous, within=within)
    except Exception:
        return False
    return True
