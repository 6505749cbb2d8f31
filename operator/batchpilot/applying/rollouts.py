"""Rolling a profile out over the replicas of a policy, a few at a time, without failing requests.

This is the one apply path: the operator and the standalone runner both come here, the runner
with replicas that carry no readiness gate.

First the replicas are surveyed: which models each one serves (the policy's, or all it loaded),
which do not answer, and which lack a model the policy names (a spec problem: nothing is
applied anywhere). Replicas already running the profile are left alone. The others are switched
in waves of `rollout.maxUnavailable`. A replica whose Pod carries the
`batchpilot.dev/config-applied` readiness gate is switched hitlessly: the gate goes False (the
Pod leaves its Services), the rollout waits for the endpoint change to spread and the replica's
queued requests to drain, applies, verifies, and sets the gate True again. A replica without the
gate is switched in place: its requests stall for the length of the reload. A replica that fails
is rolled back by the actuator and reported. Whatever raises, `_switch` alone moves the gate:
True again while the replica serves a known configuration (the new one, or the previous one:
refused, not applied, rolled back), else False with a reason and message that say why; nothing
but a cancellation raises past it. Once `maxUnavailable` replicas have failed, the rollout
stops and the rest keep their current profile until the next attempt. A replica that
does not answer is reported and skipped, and is not counted as a failure; but it serves no
one, so while `maxUnavailable` replicas are out of service (unreachable, or gated out) no other
gated replica leaves its Services: the rest are held until it is back. A Pod whose gate a pass
opened is back once it is Ready: the next wave waits for that (READY_TIMEOUT_SECONDS at most,
then the Pod counts as out of service), or a Pod reopened and another closed at the same moment
could leave a Service with no Ready endpoint.

A gated replica whose Triton container restarted after its gate opened serves its
repository's configuration again; its gate is closed first of all, so that the kubelet does not
make it Ready on that configuration, and the rollout switches it back like any other.

Every step is level-based, so a rollout interrupted at any point (an operator killed mid-way)
converges on the next pass: up-to-date replicas are skipped, and a gate left False on an
up-to-date replica is set True again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, backoffs, fleets, overrides
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_triton import servers

logger = logging.getLogger("batchpilot.rollouts")

TargetState = Literal["Updated", "Pending", "Failed", "Unreachable"]
ApplyError = Literal[
    "unreachable",
    "refused",
    "rejected",
    "rollback_failed",
    "explicit_mode_required",
    "model_unavailable",
    "credential_refused",
    "failed",
]
"""Why applying to a replica failed: the `reason` label of `batchpilot_apply_errors_total`."""
DRAIN_POLL_SECONDS = 0.2
READY_TIMEOUT_SECONDS = 30.0
"""How long a Pod whose gate a pass opened may take to be Ready before it counts as out of
service (`_Reopening`): the kubelet's readiness probe of a Triton that restarted can take a
period or two (10 s each by default)."""
QUIET_GAPS = 4
"""A drain ends once the queue is empty and no request came for this many mean gaps between
the requests it saw arrive (and at least twice its longest gap, and at least one poll): a client
sending a few a second leaves gaps longer than a poll between requests that are still coming."""


def error_of(failure: Exception) -> ApplyError:
    """The one mapping from what went wrong to the reason it is counted and reported by."""
    if isinstance(failure, overrides.ProfileRefused):
        return "refused"
    if isinstance(failure, actuators.ApplyFailed):
        return "rejected" if failure.rolled_back else "rollback_failed"
    if isinstance(failure, servers.Unreachable):
        return "unreachable"
    if isinstance(failure, servers.ExplicitModeRequired):
        return "explicit_mode_required"
    if isinstance(failure, servers.ModelUnavailable):
        return "model_unavailable"
    if isinstance(failure, servers.RepositoryLocked):
        return "credential_refused"
    return "failed"


def state_of(error: ApplyError) -> TargetState:
    return "Unreachable" if error == "unreachable" else "Failed"


class Fleet(Protocol):
    async def loaded_models(self, url: str) -> list[str]: ...

    async def runs(
        self, url: str, model: str, settings: rendering.Settings, *, profile: str
    ) -> bool: ...

    async def queue(self, url: str, models: Sequence[str]) -> fleets.QueueReading: ...

    async def apply(
        self,
        replica: Replica,
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

    async def wait_ready(self, namespace: str, pods: Sequence[str], *, within: float) -> list[str]:
        """Wait, at most `within` seconds, until each Pod is Ready; those that are not by then."""
        ...


class NoGates:
    """Gates of replicas that have none: the runner's servers are never gated."""

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        raise AssertionError(f"{pod} has no readiness gate to set")

    async def wait_ready(self, namespace: str, pods: Sequence[str], *, within: float) -> list[str]:
        raise AssertionError(f"{', '.join(pods)}: no readiness gate was opened to wait on")


class _Reopening:
    """One pass's gate writes, remembering the Pods it let back into their Services and has not
    yet seen Ready: an open gate is not yet a Pod in its Services. The kubelet still has to
    read the gate (and, after a restart, see Triton's readiness probe pass) and the endpoint
    change has to follow, so a Pod reopened and another closed at once can leave a Service
    with no Ready endpoint for a moment (requests refused at its ClusterIP)."""

    def __init__(self, gates: Gates) -> None:
        self._gates = gates
        self.pods: set[str] = set()

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        await self._gates.set_gate(namespace, pod, applied=applied, reason=reason, message=message)
        if applied:
            self.pods.add(pod)
        else:
            self.pods.discard(pod)

    async def wait_ready(self, namespace: str, pods: Sequence[str], *, within: float) -> list[str]:
        return await self._gates.wait_ready(namespace, pods, within=within)

    async def not_ready(self, namespace: str) -> list[str]:
        """Wait until the Pods this pass reopened are Ready (READY_TIMEOUT_SECONDS at most);
        the ones that are not by then."""
        if not self.pods:
            return []
        reopened, self.pods = sorted(self.pods), set()
        late = await self._gates.wait_ready(namespace, reopened, within=READY_TIMEOUT_SECONDS)
        for pod in late:
            logger.warning(
                "pod %s: not Ready %gs after its gate opened; no other Pod leaves its "
                "Services for it",
                pod,
                READY_TIMEOUT_SECONDS,
            )
        return late


@dataclass(frozen=True)
class Survey:
    """What the replicas serve, before anything is applied."""

    models: Mapping[str, Sequence[str]]
    """The models to govern, by the URL of each replica that answered."""
    unreachable: Mapping[str, servers.TritonError]
    """Replicas that could not be asked, by name."""
    missing: tuple[str, ...] = ()
    """Models the policy names that a replica does not serve: the spec cannot be applied."""


async def survey(replicas: Sequence[Replica], wanted: Sequence[str], fleet: Fleet) -> Survey:
    """Ask every replica at once which models it serves; `wanted` empty means all of them."""
    models: dict[str, list[str]] = {}
    unreachable: dict[str, servers.TritonError] = {}
    missing: list[str] = []

    async def one(replica: Replica) -> None:
        try:
            loaded = await fleet.loaded_models(replica.http_url)
        except servers.TritonError as error:
            unreachable[replica.name] = error
            return
        except Exception as error:  # an answer nobody expected: it cannot be governed now
            unreachable[replica.name] = servers.TritonError(replica.http_url, _message(error))
            return
        lacking = [model for model in wanted if model not in loaded]
        if lacking:
            missing.append(
                f"spec.target.models: {', '.join(repr(m) for m in lacking)} not loaded on "
                f"{replica.title} (it has: {', '.join(loaded) or 'no models'})"
            )
        models[replica.http_url] = list(wanted or loaded)

    await asyncio.gather(*(one(replica) for replica in replicas))
    return Survey(models, unreachable, tuple(sorted(missing)))


@dataclass(frozen=True)
class Drain:
    """A gated replica's drain: out of its Services, its queue watched until it is empty and no
    new request arrives, or until rollout.drainTimeoutSeconds."""

    seconds: float
    arrived: float
    """Requests that reached it after the settle time: clients that kept connections to the
    Pod (HTTP keep-alive, gRPC channels), or proxies that learned of its leaving late."""
    timed_out: bool

    @property
    def ineffective(self) -> bool:
        """Requests kept arriving until the timeout: clients hold connections to the Pod, and
        the reload went ahead with them still coming."""
        return self.arrived > 0 and self.timed_out

    @property
    def late(self) -> bool:
        """Requests arrived after the settle time, then stopped: the Pod's leaving reached the
        proxies late (kube-proxy on a busy node), and the drain waited for them."""
        return self.arrived > 0 and not self.timed_out


@dataclass(frozen=True)
class Outcome:
    """Where one replica stands after a rollout pass."""

    replica: Replica
    state: TargetState
    profile: str | None
    """The profile the replica runs, as last verified (None: unknown or the repository's)."""
    message: str = ""
    applied: tuple[actuators.Applied, ...] = ()
    """The reloads this pass made on it."""
    error: ApplyError | None = None
    """Why it failed this pass; None when it did not, or was not tried (backing off, halted)."""
    drain: Drain | None = None
    """How its drain went, for a gated replica this pass switched."""
    left_out: bool = False
    """A gated replica this pass took out of its Services and left out (its gate says why)."""

    @property
    def reloads(self) -> int:
        return len(self.applied)


@dataclass(frozen=True)
class Result:
    outcomes: tuple[Outcome, ...]
    """One per replica, in the order given."""
    halted: bool = False
    """The rollout stopped early because maxUnavailable replicas failed."""
    seconds: float = 0.0
    dry_run: bool = False
    """Nothing was applied: the policy runs as a dry run."""
    restarts: tuple[str, ...] = ()
    """Gated replicas whose container restarted since their gate opened, taken out of their
    Services this pass (one message each)."""

    def count(self, state: TargetState) -> int:
        return sum(outcome.state == state for outcome in self.outcomes)

    @property
    def reloads(self) -> int:
        return sum(outcome.reloads for outcome in self.outcomes)


@dataclass(frozen=True)
class Plan:
    """What to roll out, and how."""

    namespace: str
    profile: str
    settings: rendering.Settings
    rollout: specs.Rollout
    settle_seconds: float = 1.5
    """How long a Pod out of its Services is given before its queue is watched: endpoint
    changes take a moment to reach every proxy and load balancer."""


async def roll_out(
    replicas: Sequence[Replica], survey: Survey, plan: Plan, fleet: Fleet, gates: Gates
) -> Result:
    started = asyncio.get_running_loop().time()
    gates = _Reopening(gates)
    replicas, restarts = await _close_restarted(replicas, plan, gates)
    settled = [
        _unreachable(r, survey.unreachable[r.name])
        for r in replicas
        if r.name in survey.unreachable
    ]
    locked = [
        r for r in replicas if isinstance(survey.unreachable.get(r.name), servers.RepositoryLocked)
    ]
    for replica in locked:
        # It serves, and nothing was changed: a refused credential must not keep it out.
        if replica.gated and replica.gate != "True":
            await _open_gate(replica, plan, gates, reason="CredentialRefused")
    behind: list[Replica] = []
    failures = 0
    for replica in replicas:
        if replica.name in survey.unreachable:
            continue
        outcome = await _check(replica, survey.models[replica.http_url], plan, fleet)
        if outcome is None:
            behind.append(replica)
            continue
        if outcome.state == "Updated" and replica.gated and replica.gate != "True":
            # Up to date but out of its Services: an interrupted rollout left it so.
            outcome = await _settled(outcome, plan, gates, reason="ConfigApplied")
        settled.append(outcome)
        failures += outcome.state in ("Failed", "Unreachable")
    limit = plan.rollout.max_unavailable
    halted = False
    # Not serving, whatever their gates say; a refused credential's do (nothing changed).
    out = set(survey.unreachable) - {replica.name for replica in locked}
    # Gated replicas left out of their Services that this pass did not bring back.
    out |= {
        outcome.replica.name
        for outcome in settled
        if _out_of_service(outcome.replica) and (outcome.state != "Updated" or outcome.left_out)
    }
    # Replicas already out of their Services (an interrupted rollout, a restarted Triton) cost
    # nothing to switch: they go first.
    behind.sort(key=lambda replica: not _out_of_service(replica))
    while behind:
        if failures >= limit:
            halted = True
            settled.extend(
                Outcome(replica, "Pending", None, f"rollout halted after {failures} failures")
                for replica in behind
            )
            break
        wave = _next_wave(behind, limit, out)
        if any(_takes_out(replica) for replica in wave):
            # Not before the Pods this pass let back in serve: a Pod that is not Ready by
            # then counts as out of service, and the wave is chosen again.
            late = await gates.not_ready(plan.namespace)
            if late:
                out |= set(late)
                wave = _next_wave(behind, limit, out)
        if not wave:
            held = f"held: {', '.join(sorted(out))} out of service, rollout.maxUnavailable {limit}"
            settled.extend(Outcome(replica, "Pending", None, held) for replica in behind)
            break
        behind = [replica for replica in behind if replica not in wave]
        outcomes = await asyncio.gather(
            *(_switch(r, survey.models[r.http_url], plan, fleet, gates) for r in wave)
        )
        settled.extend(outcomes)
        failures += sum(outcome.state in ("Failed", "Unreachable") for outcome in outcomes)
        out |= {outcome.replica.name for outcome in outcomes if outcome.left_out}
    seconds = asyncio.get_running_loop().time() - started
    return Result(_ordered(settled, replicas), halted, seconds, restarts=restarts)


def mark_restarted(replicas: Sequence[Replica], vouched: Mapping[str, str]) -> list[Replica]:
    """The replicas, each open gate whose Pod's serving container is no longer the run
    `vouched` for it (by Pod name) marked as restarted. Runs are the runtime's own identities,
    so no clock of the operator's is compared with a node's."""
    marked = []
    for replica in replicas:
        known, serving = vouched.get(replica.name), replica.serving
        if (
            replica.gated
            and replica.gate == "True"
            and serving
            and known not in (None, serving.run)
        ):
            replica = dataclasses.replace(
                replica,
                restarted=f"container {serving.name} restarted"
                if serving.run
                else f"container {serving.name} is not running ({serving.stopped})",
            )
        marked.append(replica)
    return marked


def vouched_after(result: Result, vouched: Mapping[str, str]) -> dict[str, str]:
    """The runs to vouch for after a pass: a gated replica the pass left open on the profile
    vouches for the run it was read with; the others keep what was known (a Pod gone is
    forgotten)."""
    kept = {}
    for outcome in result.outcomes:
        replica = outcome.replica
        if replica.gated and replica.serving is not None:
            if outcome.state == "Updated" and not outcome.left_out and replica.serving.run:
                kept[replica.name] = replica.serving.run
            elif replica.name in vouched:
                kept[replica.name] = vouched[replica.name]
    return kept


async def _close_restarted(
    replicas: Sequence[Replica], plan: Plan, gates: Gates
) -> tuple[list[Replica], tuple[str, ...]]:
    """Close, before anything else, the gates a container restart made stale: the kubelet makes
    such a Pod Ready as soon as Triton answers its probe, serving its repository's
    configuration. Closed, the Pod waits out of its Services until the rollout has applied the
    profile (at once if Triton answers, else once it does). A gate that cannot be written now is
    tried again on the next pass."""
    checked: list[Replica] = []
    notes: list[str] = []
    for replica in replicas:
        if replica.restarted:  # set by mark_restarted on open gates only
            message = (
                f"{replica.restarted} since it last served {plan.profile}; out of its Services "
                "until it does again"
            )
            try:
                await gates.set_gate(
                    plan.namespace,
                    replica.name,
                    applied=False,
                    reason="ContainerRestarted",
                    message=message,
                )
            except Exception as failure:
                logger.warning("%s: closing its readiness gate: %s", replica.title, failure)
            else:
                replica = dataclasses.replace(replica, gate="False")
                notes.append(f"{replica.title}: {message}")
        checked.append(replica)
    return checked, tuple(notes)


def _out_of_service(replica: Replica) -> bool:
    """A gated replica whose gate is not True: its Pod is not Ready, so out of its Services."""
    return replica.gated and replica.gate != "True"


def _takes_out(replica: Replica) -> bool:
    """Switching the replica takes a Pod that serves out of its Services."""
    return replica.gated and not _out_of_service(replica)


def _next_wave(behind: Sequence[Replica], limit: int, out: set[str]) -> list[Replica]:
    """Up to `limit` replicas to switch side by side. A gated replica that serves is taken out
    of its Services only while fewer than `limit` replicas are out (unreachable, gated False,
    or in this wave): a dead Pod must not leave one Pod fewer serving than the budget allows.
    Ungated replicas switch in place (their requests stall, none fail), so only `limit` bounds
    them."""
    room = limit - len(out) - sum(_out_of_service(replica) for replica in behind)
    wave: list[Replica] = []
    for replica in behind:
        if len(wave) == limit:
            break
        if _takes_out(replica):
            if room <= 0:
                continue
            room -= 1
        wave.append(replica)
    return wave


def dry_run(replicas: Sequence[Replica], survey: Survey) -> Result:
    """What a dry run reports: nothing applied, unreachable replicas said so."""
    outcomes = [
        _unreachable(replica, survey.unreachable[replica.name])
        if replica.name in survey.unreachable
        else Outcome(replica, "Pending", None, "dry run: nothing applied")
        for replica in replicas
    ]
    return Result(tuple(outcomes), dry_run=True)


async def open_gates(
    replicas: Sequence[Replica], namespace: str, gates: Gates, *, reason: str, message: str
) -> list[str]:
    """Set True every gate that is not: for Pods no rollout of the policy will bring back into
    their Services. The names of the Pods opened."""
    opened = []
    for replica in replicas:
        if replica.gated and replica.gate != "True":
            await gates.set_gate(
                namespace, replica.name, applied=True, reason=reason, message=message
            )
            opened.append(replica.name)
    return opened


async def open_gates_for_dry_run(replicas: Sequence[Replica], namespace: str, gates: Gates) -> None:
    """A dry run changes no Triton server, but must not keep gated Pods out of service."""
    await open_gates(
        replicas,
        namespace,
        gates,
        reason="DryRun",
        message="batchpilot runs this policy as a dry run",
    )


def _ordered(outcomes: Sequence[Outcome], replicas: Sequence[Replica]) -> tuple[Outcome, ...]:
    order = {replica.name: index for index, replica in enumerate(replicas)}
    return tuple(sorted(outcomes, key=lambda outcome: order[outcome.replica.name]))


def _unreachable(replica: Replica, error: servers.TritonError) -> Outcome:
    # Backing off, it was not asked this pass: there is no fresh failure to count.
    fresh = None if isinstance(error, backoffs.BackingOff) else error_of(error)
    return Outcome(replica, state_of(error_of(error)), None, error.message, error=fresh)


def _failed(
    replica: Replica, failure: Exception, applied: Sequence[actuators.Applied] = ()
) -> Outcome:
    error = error_of(failure)
    return Outcome(replica, state_of(error), None, _message(failure), tuple(applied), error)


def _message(failure: BaseException) -> str:
    if isinstance(failure, servers.TritonError):
        return failure.message
    if isinstance(failure, overrides.ProfileRefused):
        return str(failure)
    # Not one of the failures the apply path names: say what it was, whatever it was.
    return f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__


async def _check(
    replica: Replica, models: Sequence[str], plan: Plan, fleet: Fleet
) -> Outcome | None:
    """The replica's outcome if nothing needs doing (or cannot be done); None to switch it."""
    try:
        for model in models:
            if not await fleet.runs(replica.http_url, model, plan.settings, profile=plan.profile):
                return None
    except Exception as failure:  # its gate is untouched: the failure is only reported
        return _failed(replica, failure)
    return Outcome(replica, "Updated", plan.profile)


def serving_reason(failure: BaseException) -> str | None:
    """The gate reason when a failed switch left the replica serving a known configuration
    (the one it served before, model by model), None when what it serves is unknown."""
    if isinstance(failure, overrides.ProfileRefused):
        return "Refused"
    if isinstance(failure, actuators.ApplyFailed):
        return "RolledBack" if failure.rolled_back else None
    if isinstance(failure, actuators.NotApplied | servers.ExplicitModeRequired):
        return "NotApplied"
    if isinstance(failure, servers.RepositoryLocked):
        return "CredentialRefused"  # refused before anything changed
    return None


def closed_reason(failure: BaseException) -> str:
    """The gate reason of a replica a failed switch leaves out of its Services."""
    if isinstance(failure, actuators.ApplyFailed):
        return "RollbackFailed"
    if isinstance(failure, servers.Unreachable):
        return "Unreachable"
    if isinstance(failure, servers.ModelUnavailable):
        return "ModelUnavailable"
    if isinstance(failure, asyncio.CancelledError):
        return "Interrupted"
    return "SwitchFailed"


async def _switch(
    replica: Replica, models: Sequence[str], plan: Plan, fleet: Fleet, gates: Gates
) -> Outcome:
    """Switch one replica. The one place a switch moves a readiness gate: whatever is raised
    on the way, a gated replica ends with its gate True while it serves a known configuration,
    or False with a reason and message that say why (never the "Switching" it closed with)."""
    if not replica.gated:
        outcome, _ = await _apply(replica, models, plan, fleet)
        return outcome
    try:
        await gates.set_gate(
            plan.namespace,
            replica.name,
            applied=False,
            reason="Switching",
            message=f"draining before applying {plan.profile}",
        )
    except Exception as gate_failure:  # nothing was applied, and the Pod was never taken out
        return dataclasses.replace(
            _failed(replica, gate_failure),
            message=f"closing its readiness gate: {_message(gate_failure)}",
        )
    try:
        drain = await _drain(replica, models, plan, fleet)
        if drain.ineffective:
            logger.warning(
                "%s kept receiving requests after leaving its Services (%g in %.1fs); "
                "reloading anyway",
                replica.title,
                drain.arrived,
                drain.seconds,
            )
        elif drain.late:
            logger.info(
                "%s received requests after the settle time, then none (%g in %.1fs): "
                "its leaving reached the proxies late",
                replica.title,
                drain.arrived,
                drain.seconds,
            )
        outcome, failure = await _apply(replica, models, plan, fleet)
    except asyncio.CancelledError as cancelled:
        # The operator is stopping or the policy went away mid-switch: what the server runs
        # is unknown until the next pass looks, so the Pod stays out, saying why.
        with contextlib.suppress(Exception):
            await _close_gate(replica, plan, gates, cancelled, "the switch was interrupted")
        raise
    outcome = dataclasses.replace(outcome, drain=drain)
    if failure is None:
        return await _settled(outcome, plan, gates, reason="ConfigApplied")
    serving = serving_reason(failure)
    if serving is not None:
        return await _settled(outcome, plan, gates, reason=serving)
    return await _settled(outcome, plan, gates, closed=failure)


async def _apply(
    replica: Replica, models: Sequence[str], plan: Plan, fleet: Fleet
) -> tuple[Outcome, Exception | None]:
    """Apply to every model of the replica, one after another; the outcome, and what stopped
    it (None if nothing did). Every exception but a cancellation ends here."""
    applied: list[actuators.Applied] = []
    try:
        for model in models:
            done = await fleet.apply(
                replica,
                model,
                plan.settings,
                profile=plan.profile,
                unload_first=plan.rollout.unload_before_load,
                verify_timeout=plan.rollout.verify_timeout_seconds,
            )
            for note in done.notes:
                logger.warning("%s on %s: %s", model, replica.title, note)
            if done.reloaded:
                applied.append(done)
                logger.info(
                    "applied %s to %s on %s in %.2fs (was %s)",
                    done.profile,
                    model,
                    replica.title,
                    done.seconds,
                    done.previous_profile or "the repository configuration",
                )
    except Exception as failure:
        return _failed(replica, failure, applied), failure
    notes = "; ".join(f"{done.model}: {note}" for done in applied for note in done.notes)
    return Outcome(replica, "Updated", plan.profile, notes, tuple(applied)), None


async def _settled(
    outcome: Outcome,
    plan: Plan,
    gates: Gates,
    *,
    reason: str = "",
    closed: BaseException | None = None,
) -> Outcome:
    """Set the gate of a switched replica: True with `reason`, or False because of `closed`.
    A gate that cannot be written is a failure of its own: the Pod stays where it is, and a
    later pass sets it (up-to-date replicas with a closed gate are opened)."""
    try:
        if closed is None:
            await _open_gate(outcome.replica, plan, gates, reason=reason)
        else:
            await _close_gate(outcome.replica, plan, gates, closed, outcome.message)
            return dataclasses.replace(outcome, left_out=True)
    except Exception as failure:
        action = "opening" if closed is None else "closing"
        return dataclasses.replace(
            outcome,
            state="Failed",
            error=outcome.error or "failed",
            left_out=True,
            message="; ".join(
                part
                for part in (outcome.message, f"{action} its readiness gate: {_message(failure)}")
                if part
            ),
        )
    return outcome


async def _close_gate(
    replica: Replica, plan: Plan, gates: Gates, failure: BaseException, message: str
) -> None:
    """Leave the gate False, with the reason the replica is out of its Services."""
    await gates.set_gate(
        plan.namespace,
        replica.name,
        applied=False,
        reason=closed_reason(failure),
        message=f"switching to {plan.profile}: {message}"[:1024],
    )


async def _drain(replica: Replica, models: Sequence[str], plan: Plan, fleet: Fleet) -> Drain:
    """Give the Pod the settle time to leave its Services, then wait, within the drain timeout,
    until its queue is empty and no new request came for a quiet window that scales with the
    gaps between the requests it saw (`QUIET_GAPS`).

    Requests that arrive after the settle time are counted: what reached the Pod is what it
    completed plus what its queue grew by. A client that keeps connections to the Pod (HTTP
    keep-alive, a gRPC channel) keeps sending there whatever the Service's endpoints say."""
    clock = asyncio.get_running_loop().time
    started = clock()
    deadline = started + plan.rollout.drain_timeout_seconds
    try:
        closed: fleets.QueueReading | None = await fleet.queue(replica.http_url, models)
    except Exception:  # the rate is unknown then; the look after the settle time tries again
        closed = None
    await asyncio.sleep(min(plan.settle_seconds, plan.rollout.drain_timeout_seconds))
    arrived = 0.0
    try:
        last = await fleet.queue(replica.http_url, models)
        quiet = _QuietWindow(clock, started, settled=_arrivals(closed, last) if closed else 0.0)
        while clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
            now = await fleet.queue(replica.http_url, models)
            new = _arrivals(last, now)
            arrived += new
            quiet.arrived(new)
            last = now
            if now.pending == 0 and quiet.over():
                return Drain(clock() - started, arrived, timed_out=False)
    except Exception as error:
        # The drain is best effort: the apply meets the same problem and reports it.
        logger.debug("%s: drain cut short: %s", replica.title, _message(error))
    return Drain(clock() - started, arrived, timed_out=clock() >= deadline)


def _arrivals(before: fleets.QueueReading, after: fleets.QueueReading) -> float:
    """Requests that reached a server between two readings: what it completed plus what its
    queue grew by (none when its counters went back: it restarted in between)."""
    completed = after.completed - before.completed
    if completed < 0:
        return 0.0
    return max(completed + after.pending - before.pending, 0.0)


class _QuietWindow:
    """How long a drain must see no request before it takes the clients to have stopped. Quiet
    counts from the end of the settle time: the requests of the settle time (`settled`) set the
    rate, not the silence."""

    def __init__(self, clock: Callable[[], float], started: float, *, settled: float) -> None:
        self._clock = clock
        self._started = started
        self._seen = settled
        self._since = clock()
        self._last_seen = self._since if settled > 0 else started
        self._longest_gap = 0.0

    def arrived(self, count: float) -> None:
        if count <= 0:
            return
        now = self._clock()
        self._seen += count
        self._longest_gap = max(self._longest_gap, now - self._since)
        self._since = self._last_seen = now

    def over(self) -> bool:
        now = self._clock()
        window = DRAIN_POLL_SECONDS
        if self._seen:
            # The gaps while requests came, not since: a rate that fell with the waiting
            # would keep a Pod that had two requests waiting until the timeout.
            mean_gap = (self._last_seen - self._started) / self._seen
            window = max(window, QUIET_GAPS * mean_gap, 2 * self._longest_gap)
        return now - self._since >= window - 1e-9


async def _open_gate(replica: Replica, plan: Plan, gates: Gates, *, reason: str) -> None:
    await gates.set_gate(
        plan.namespace,
        replica.name,
        applied=True,
        reason=reason,
        message=f"batchpilot profile {plan.profile}"
        if reason == "ConfigApplied"
        else f"{reason}: the previous configuration serves",
    )
