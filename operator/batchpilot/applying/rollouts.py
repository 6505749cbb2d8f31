"""Rolling a profile out over the replicas of a policy, a few at a time, without failing requests.

Replicas already running the profile are left alone. The others are switched in waves of
`rollout.maxUnavailable`. A replica whose Pod carries the `batchpilot.dev/config-applied`
readiness gate is switched hitlessly: the gate goes False (the Pod leaves its Services), the
operator waits for the endpoint change to spread and the replica's queued requests to drain,
applies, verifies, and sets the gate True again. A replica without the gate is switched in
place: its requests stall for the length of the reload. A replica that fails is rolled back by
the actuator and reported; once `maxUnavailable` replicas have failed, the rollout stops and
the rest keep their current profile until the next attempt.

Every step is level-based, so a rollout interrupted at any point (an operator killed mid-way)
converges on the next reconcile: up-to-date replicas are skipped, and a gate left False on an
up-to-date replica is set True again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from batchpilot.applying import actuators, overrides
from batchpilot.kube.pods import Target
from batchpilot.policy import rendering, specs
from batchpilot_triton import servers

TargetState = Literal["Updated", "Pending", "Failed", "Unreachable"]
DRAIN_POLL_SECONDS = 0.2


class Fleet(Protocol):
    async def loaded_models(self, url: str) -> list[str]: ...

    async def runs(
        self, url: str, model: str, settings: rendering.Settings, *, profile: str
    ) -> bool: ...

    async def pending_requests(self, url: str, models: Sequence[str]) -> float: ...

    async def apply(
        self,
        url: str,
        model: str,
        settings: rendering.Settings,
        *,
        profile: str,
        unload_first: bool,
        verify_timeout: float,
    ) -> actuators.Applied: ...


class Gates(Protocol):
    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """Where one replica stands after a rollout pass."""

    target: Target
    state: TargetState
    profile: str | None
    """The profile the replica runs, as last verified (None: unknown or the repository's)."""
    message: str = ""
    reloads: int = 0
    rolled_back: bool = False


@dataclass(frozen=True)
class Result:
    outcomes: tuple[Outcome, ...]
    halted: bool
    """The rollout stopped early because maxUnavailable replicas failed."""
    seconds: float

    def count(self, state: TargetState) -> int:
        return sum(outcome.state == state for outcome in self.outcomes)


@dataclass(frozen=True)
class Plan:
    """What to roll out, and how."""

    namespace: str
    profile: str
    settings: rendering.Settings
    models: dict[str, list[str]]
    """Models to govern, per target URL."""
    rollout: specs.Rollout
    settle_seconds: float = 1.5
    """How long a Pod out of its Services is given before its queue is watched: endpoint
    changes take a moment to reach every proxy and load balancer."""


async def roll_out(targets: Sequence[Target], plan: Plan, fleet: Fleet, gates: Gates) -> Result:
    started = asyncio.get_running_loop().time()
    settled: list[Outcome] = []
    behind: list[Target] = []
    for target in targets:
        outcome = await _check(target, plan, fleet)
        if outcome is None:
            behind.append(target)
            continue
        settled.append(outcome)
        if outcome.state == "Updated" and target.gated and target.gate != "True":
            # Up to date but out of its Services: an interrupted rollout left it so.
            await _open_gate(target, plan, gates, reason="ConfigApplied")
    failures = sum(outcome.state in ("Failed", "Unreachable") for outcome in settled)
    limit = plan.rollout.max_unavailable
    halted = False
    for first in range(0, len(behind), limit):
        wave = behind[first : first + limit]
        if failures >= limit:
            halted = True
            settled.extend(
                Outcome(target, "Pending", None, f"rollout halted after {failures} failures")
                for target in behind[first:]
            )
            break
        outcomes = await asyncio.gather(*(_switch(target, plan, fleet, gates) for target in wave))
        settled.extend(outcomes)
        failures += sum(outcome.state in ("Failed", "Unreachable") for outcome in outcomes)
    order = {target.name: index for index, target in enumerate(targets)}
    ordered = tuple(sorted(settled, key=lambda outcome: order[outcome.target.name]))
    return Result(ordered, halted, asyncio.get_running_loop().time() - started)


async def _check(target: Target, plan: Plan, fleet: Fleet) -> Outcome | None:
    """The replica's outcome if nothing needs doing (or cannot be done); None to switch it."""
    try:
        for model in plan.models[target.http_url]:
            if not await fleet.runs(target.http_url, model, plan.settings, profile=plan.profile):
                return None
    except overrides.ProfileRefused as refused:
        return Outcome(target, "Failed", None, str(refused))
    except servers.Unreachable as error:
        return Outcome(target, "Unreachable", None, error.message)
    except servers.TritonError as error:
        return Outcome(target, "Failed", None, error.message)
    return Outcome(target, "Updated", plan.profile)


async def _switch(target: Target, plan: Plan, fleet: Fleet, gates: Gates) -> Outcome:
    models = plan.models[target.http_url]
    if target.gated:
        await gates.set_gate(
            plan.namespace,
            target.name,
            applied=False,
            reason="Switching",
            message=f"draining before applying {plan.profile}",
        )
        await _drain(target, models, plan, fleet)
    reloads = 0
    try:
        for model in models:
            applied = await fleet.apply(
                target.http_url,
                model,
                plan.settings,
                profile=plan.profile,
                unload_first=plan.rollout.unload_before_load,
                verify_timeout=plan.rollout.verify_timeout_seconds,
            )
            reloads += applied.reloaded
    except actuators.ApplyFailed as failure:
        if target.gated and failure.rolled_back:
            await _open_gate(target, plan, gates, reason="RolledBack")
        return Outcome(target, "Failed", None, failure.message, reloads, failure.rolled_back)
    except overrides.ProfileRefused as refused:
        if target.gated:
            await _open_gate(target, plan, gates, reason="Refused")
        return Outcome(target, "Failed", None, str(refused), reloads)
    except servers.TritonError as error:
        state: TargetState = "Unreachable" if isinstance(error, servers.Unreachable) else "Failed"
        return Outcome(target, state, None, error.message, reloads)
    if target.gated:
        await _open_gate(target, plan, gates, reason="ConfigApplied")
    return Outcome(target, "Updated", plan.profile, "", reloads)


async def _drain(target: Target, models: Sequence[str], plan: Plan, fleet: Fleet) -> None:
    """Wait, within the drain timeout, for the Pod to leave its Services and its queue to empty."""
    deadline = asyncio.get_running_loop().time() + plan.rollout.drain_timeout_seconds
    await asyncio.sleep(min(plan.settle_seconds, plan.rollout.drain_timeout_seconds))
    while asyncio.get_running_loop().time() < deadline:
        try:
            if await fleet.pending_requests(target.http_url, models) == 0:
                return
        except servers.TritonError:
            return  # the apply will meet the same problem and report it
        await asyncio.sleep(DRAIN_POLL_SECONDS)


async def _open_gate(target: Target, plan: Plan, gates: Gates, *, reason: str) -> None:
    await gates.set_gate(
        plan.namespace,
        target.name,
        applied=True,
        reason=reason,
        message=f"batchpilot profile {plan.profile}"
        if reason == "ConfigApplied"
        else f"{reason}: the previous configuration serves",
    )
