"""One pass over one policy: observe, decide, act, report.

This is the engine both drivers run: the operator's per-policy daemon (`batchpilot.operating`)
with Pods for replicas and readiness gates, and the standalone runner (`batchpilot.running`)
with the servers on its command line and no gates.

- **observe** (I/O): the replicas, what models each serves, the load signals;
- **decide** (pure): `batchpilot.policy.decisions.decide`;
- **act** (I/O): the rollout (`batchpilot.applying.rollouts`), or, in a dry run, nothing;
- **report** (pure): the status and the events (`batchpilot.reporting`), then the metrics.

Nothing here knows kopf, so it is tested with fakes at the Kubernetes and Triton boundaries.
Between passes it keeps only `PolicyMemory`: the decision engine's memory, the signal source
(whose rates need the previous scrape) and the standing problems already reported.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchpilot import reporting, telemetry
from batchpilot.api import documents
from batchpilot.api.v1alpha1 import specs, statuses
from batchpilot.applying import canaries, credentials, rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import decisions, governing, leads, rendering
from batchpilot.signals import sources
from batchpilot_triton import servers

SIGNAL_TIMEOUT_SECONDS = 5.0
"""A policy's budget for its signals each tick; every source's own deadlines fit inside it."""
WAVES_REMEMBERED = 5


class ReplicaSource(Protocol):
    async def replicas(
        self, namespace: str, target: specs.Target
    ) -> tuple[list[Replica], list[str]]: ...


class NotInjectedSource(Protocol):
    async def not_injected(self, namespace: str, selector: specs.LabelSelector) -> list[str]:
        """Pods the selector matches that opted into the admission webhook and were created
        without its injection (`kube.pods`)."""
        ...


class SignalSource(Protocol):
    async def read(self) -> sources.Reading: ...

    async def close(self) -> None: ...


StatusProgress = Callable[[dict[str, Any]], Awaitable[None]]
"""Writes a status while the pass runs: the one a rollout to a new profile starts with."""

GovernorSource = Callable[[str], Sequence[governing.Governor]]
"""Every policy of a namespace, as the Pods it selects see it (the operator's index of them)."""

SignalSourceFactory = Callable[[str, specs.BatchPolicySpec, Sequence[Replica]], SignalSource]
"""Builds the signal source for (namespace, policy, replicas)."""


class Fleet(rollouts.Fleet, Protocol):
    async def hold(
        self,
        holder: Hashable,
        urls: Sequence[str],
        *,
        repository_headers: Mapping[str, str] | None = None,
    ) -> None: ...

    async def release(self, holder: Hashable) -> None: ...

    async def close(self) -> None: ...


@dataclass
class PolicyMemory:
    """What the engine keeps about one policy between passes, in memory only."""

    memory: decisions.Memory = field(default_factory=decisions.Memory)
    source: SignalSource | None = None
    source_key: tuple[str, ...] = ()
    announced: dict[str, str] = field(default_factory=dict)
    """Last message per standing problem, so it is reported once, not every tick."""
    wave_seconds: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=WAVES_REMEMBERED)
    )
    """How long one wave took in the policy's recent rollouts."""
    recent_rollouts: collections.deque[tuple[leads.Wave, frozenset[str]]] = field(
        default_factory=lambda: collections.deque(maxlen=WAVES_REMEMBERED)
    )
    """The policy's recent rollouts, and the hosts they reloaded on: which other rollouts ran
    beside them (`leads.Contention`)."""
    contended: tuple[int, float | None] = (-1, None)
    """The longest wave beside its rollouts, and how many waves the contention had recorded when
    it was read: every pass asks, and it changes only when a wave is recorded."""
    vouched: dict[str, str] = field(default_factory=dict)
    """Per gated Pod, the run of its serving container last seen serving the profile with its
    gate open: a different run has Triton's repository configuration (`rollouts.mark_restarted`).
    """
    canary: canaries.CanaryMemory = field(default_factory=canaries.CanaryMemory)
    """Which settings the fleet served, proved and failed, and the canary under way."""

    @property
    def measured_wave_seconds(self) -> float | None:
        """The longest recent wave: leads are better early than late."""
        return max(self.wave_seconds, default=None)

    def announce(self, notices: Sequence[reporting.Notice]) -> tuple[reporting.Event, ...]:
        """The events to post: every plain one, and standing problems that began or changed."""
        posted = []
        for notice in notices:
            if notice.key is None:
                posted.extend([notice.event] if notice.event else [])
            elif notice.event is None:
                self.announced.pop(notice.key, None)
            elif self.announced.get(notice.key) != notice.event.message:
                self.announced[notice.key] = notice.event.message
                posted.append(notice.event)
        return tuple(posted)

    def resume(self, previous: statuses.BatchPolicyStatus, policy: specs.BatchPolicySpec) -> None:
        """A restarted operator carries on from the status: no switch, dwell respected, the
        rollouts it measured remembered."""
        if self.memory.profile is None and previous.active_profile in policy.profiles:
            self.memory = decisions.Memory(
                profile=previous.active_profile, since=previous.last_transition_time
            )
        if not self.wave_seconds and previous.measured_wave_seconds is not None:
            self.wave_seconds.append(previous.measured_wave_seconds)
        self.canary.resume(previous)

    def contended_wave_seconds(self, contention: leads.Contention) -> float | None:
        """The longest wave of the rollouts that ran beside this policy's on its hosts."""
        recorded, seconds = self.contended
        if recorded != contention.recorded:
            found = [contention.busiest(hosts, [wave]) for wave, hosts in self.recent_rollouts]
            seconds = max((s for s in found if s is not None), default=None)
            self.contended = (contention.recorded, seconds)
        return seconds

    def planned_wave_seconds(self, contention: leads.Contention) -> float | None:
        """The wave leadTime auto plans for: the longest of its own and those beside them."""
        measured = [self.measured_wave_seconds, self.contended_wave_seconds(contention)]
        return max((seconds for seconds in measured if seconds is not None), default=None)

    def remember_rollout(
        self,
        result: rollouts.Result,
        max_unavailable: int,
        *,
        ended: datetime.datetime,
        contention: leads.Contention,
    ) -> None:
        self.vouched = rollouts.vouched_after(result, self.vouched)
        switched = [outcome.replica.host for outcome in result.outcomes if outcome.reloads > 0]
        seconds = leads.wave_seconds(
            result.seconds, switched=len(switched), max_unavailable=max_unavailable
        )
        if seconds is None or result.halted:
            return
        self.wave_seconds.append(seconds)
        wave = leads.Wave(ended - datetime.timedelta(seconds=result.seconds), ended, seconds)
        self.recent_rollouts.append((wave, frozenset(switched)))
        contention.record(switched, wave)

    async def close_source(self) -> None:
        if self.source is not None:
            source, self.source = self.source, None
            await source.close()


@dataclass(frozen=True)
class Reconciled:
    """What a pass found and did: the status and events to publish, and when to come back."""

    at: datetime.datetime
    status: dict[str, Any]
    events: tuple[reporting.Event, ...]
    wake_at: datetime.datetime | None
    decision: decisions.Decision | None = None
    rollout: rollouts.Result | None = None
    reading: sources.Reading = field(default_factory=lambda: sources.Reading(decisions.Signals()))


@dataclass(frozen=True)
class _Observed:
    replicas: list[Replica]
    skipped: list[str]
    contested: list[str]
    survey: rollouts.Survey
    reading: sources.Reading
    lead: leads.Lead
    credential_problem: str | None = None
    limited: tuple[str, ...] = ()
    not_injected: tuple[str, ...] = ()


def _rolls_out_a_new_profile(
    policy: specs.BatchPolicySpec,
    decision: decisions.Decision,
    observed: _Observed,
    previous: statuses.BatchPolicyStatus,
) -> bool:
    """Whether this pass is about to roll out a profile the status does not show yet."""
    return (
        not policy.dry_run
        and bool(observed.replicas)
        and not observed.survey.missing
        and observed.credential_problem is None
        and decision.profile != previous.active_profile
    )


def _wake_at(decision: decisions.Decision | None) -> datetime.datetime | None:
    """When the next scheduled change is decided: at its rollout start, which a lead makes
    earlier than the boundary."""
    if decision is None:
        return None
    return decision.rollout_starts or decision.next_transition


async def _unsurveyed() -> rollouts.Survey:
    return rollouts.Survey(models={}, unreachable={})


def _refused_credential(error: servers.TritonError) -> bool:
    """Triton refused the credential's value (not a server that is no Triton)."""
    return isinstance(error, servers.RepositoryLocked) and not isinstance(error, servers.NotTriton)


def _no_credentials() -> credentials.CredentialSource:
    return credentials.NoCredentials()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Reconciler:
    def __init__(
        self,
        *,
        replicas: ReplicaSource,
        gates: rollouts.Gates,
        fleet: Fleet,
        signal_source: SignalSourceFactory,
        metrics: telemetry.ControllerMetrics,
        clock: Callable[[], datetime.datetime] = _now,
        settle_seconds: float = 1.5,
        governors: GovernorSource | None = None,
        credential_source: credentials.CredentialSource | None = None,
        limits: governing.Limits | None = None,
        not_injected: NotInjectedSource | None = None,
    ) -> None:
        self.replica_source = replicas
        self.not_injected = not_injected
        """None where no webhook injects Pods (the runner): nothing to find."""
        self.gates = gates
        self.fleet = fleet
        self.signal_source = signal_source
        self.metrics = metrics
        self.clock = clock
        self.settle_seconds = settle_seconds
        self.governors = governors
        """None: one policy governs every replica it is given (the runner's)."""
        self.credentials = credential_source or _no_credentials()
        self.limits = limits or governing.Limits()
        self.contention = leads.Contention()
        """Every policy's recent waves by host, so each plans for the busiest it ran beside."""

    async def forget_policy(self, namespace: str, name: str) -> None:
        """The policy is gone (or this replica no longer governs it): its series leave the
        metrics page, its servers no longer keep their clients open."""
        self.metrics.forget(telemetry.PolicyLabels(namespace, name))
        await self.fleet.release((namespace, name))

    async def release_pods(
        self, namespace: str, spec: Mapping[str, Any], *, name: str = ""
    ) -> list[str]:
        """The policy is deleted: a rollout it left half way will never finish, so every gate of
        its Pods that is not True opens (each Pod serves the configuration it runs), but for
        Pods another policy governs. The names of the Pods opened; none if the spec no longer
        says which Pods are its."""
        try:
            target = specs.Target.model_validate(spec.get("target") or {})
        except ValueError:
            return []
        selected, _ = await self.replica_source.replicas(namespace, target)
        replicas, _ = self._governed(namespace, name, selected)
        return await rollouts.open_gates(
            replicas,
            namespace,
            self.gates,
            reason="PolicyDeleted",
            message="the batchpilot policy that governed this Pod was deleted",
        )

    async def reconcile(
        self,
        *,
        namespace: str,
        name: str,
        spec: Mapping[str, Any] | specs.BatchPolicySpec,
        status: Mapping[str, Any],
        generation: int | None,
        state: PolicyMemory,
        progress: StatusProgress | None = None,
    ) -> Reconciled:
        """One pass; with `progress`, a rollout to a newly decided profile is announced in the
        status before it starts (`reporting.rolling_out`)."""
        now = self.clock()
        found = reporting.Findings(now=now.replace(microsecond=0), generation=generation)
        previous = reporting.previous_status(status)
        try:
            policy = (
                spec
                if isinstance(spec, specs.BatchPolicySpec)
                else documents.parse_spec(dict(spec))
            )
        except documents.PolicyError as error:
            problems = tuple(str(problem) for problem in error.problems)
            return self._report(
                telemetry.PolicyLabels(namespace, name),
                dataclasses.replace(found, problems=problems),
                previous,
                state,
            )
        state.resume(previous, policy)

        observed = await self._observe(namespace, name, policy, state)
        decision = decisions.decide(
            policy, now, observed.reading.signals, state.memory, lead=observed.lead.lead
        )
        previous_profile, state.memory = state.memory.profile, decision.memory
        if progress is not None and _rolls_out_a_new_profile(policy, decision, observed, previous):
            decided = dataclasses.replace(
                found, policy=policy, decision=decision, replicas=observed.replicas
            )
            # The pass's own status follows from this one: its conditions keep their times.
            previous = reporting.rolling_out(decided, previous)
            await progress(reporting.document(previous))
        passed = await self._act(
            namespace, policy, decision, observed, state=state, generation=generation, now=now
        )
        result = passed.result if passed else None
        if result is not None:
            state.remember_rollout(
                result,
                policy.rollout.max_unavailable,
                ended=self.clock(),
                contention=self.contention,
            )

        found = dataclasses.replace(
            found,
            problems=observed.survey.missing,
            policy=policy,
            decision=decision,
            previous_profile=previous_profile,
            replicas=observed.replicas,
            skipped=observed.skipped,
            contested=observed.contested,
            limited=observed.limited,
            not_injected=observed.not_injected,
            result=result,
            lead=observed.lead,
            measured_wave_seconds=state.planned_wave_seconds(self.contention),
            credential_problem=observed.credential_problem,
            canary=state.canary.analysis.status() if state.canary.analysis else None,
            settings_history=state.canary.history(),
            canary_notes=passed.notes if passed else (),
            canary_failure=(
                state.canary.failure(rendering.settings_hash(decision.settings))
                if policy.rollout.canary is not None
                else None
            ),
            signal_problems=(
                *observed.reading.problems,
                *reporting.missing_signals(policy, observed.reading.signals.metrics),
            ),
        )
        return self._report(
            telemetry.PolicyLabels(namespace, name), found, previous, state, observed.reading
        )

    async def _observe(
        self, namespace: str, name: str, policy: specs.BatchPolicySpec, state: PolicyMemory
    ) -> _Observed:
        selected, skipped = await self.replica_source.replicas(namespace, policy.target)
        governed, contested = self._governed(namespace, name, selected)
        replicas, limited = self._within_limits(namespace, name, governed)
        problem = None
        try:
            headers = await self.credentials.repository_headers(
                namespace, policy.target.repository_credential
            )
        except credentials.CredentialUnavailable as error:
            headers, problem = {}, str(error)
        await self.fleet.hold(
            (namespace, name),
            [replica.http_url for replica in replicas],
            repository_headers=headers,
        )
        # Without its credential no server is asked anything of its repository.
        surveyed = (
            rollouts.survey(replicas, policy.target.models, self.fleet)
            if problem is None
            else _unsurveyed()
        )
        survey, reading = await asyncio.gather(
            surveyed, self._signals(namespace, policy, replicas, state)
        )
        if any(_refused_credential(error) for error in survey.unreachable.values()):
            self.credentials.forget(namespace, policy.target.repository_credential)
        lead = leads.lead_for(
            policy,
            replicas=len(replicas),
            wave_seconds=state.measured_wave_seconds,
            contended_wave_seconds=state.contended_wave_seconds(self.contention),
            through_canary=canaries.leads_through_canary(policy, state.canary),
        )
        not_injected = (
            await self.not_injected.not_injected(namespace, policy.target.selector)
            if self.not_injected is not None
            else []
        )
        return _Observed(
            replicas,
            skipped,
            contested,
            survey,
            reading,
            lead,
            problem,
            limited,
            tuple(not_injected),
        )

    def _within_limits(
        self, namespace: str, name: str, governed: list[Replica]
    ) -> tuple[list[Replica], tuple[str, ...]]:
        """The replicas the operator's limits leave this policy, and what they left out."""
        policies = sorted(
            self.governors(namespace) if self.governors is not None else (),
            key=lambda policy: policy.seniority,
        )
        most = self.limits.policies_per_namespace
        if [policy.name for policy in policies[most:]].count(name):
            return [], (
                f"the namespace has more than {most} policies, the operator's limit "
                "(--max-policies-per-namespace): this one, among the newest, governs no Pod "
                "while the older ones are there",
            )
        most = self.limits.pods_per_policy
        if len(governed) > most:
            return governed[:most], (
                f"the policy governs {len(governed)} Pods, more than the operator's limit of "
                f"{most} a policy (--max-pods-per-policy): the first {most} by name are "
                "governed, the others left alone",
            )
        return governed, ()

    def _governed(
        self, namespace: str, name: str, selected: Sequence[Replica]
    ) -> tuple[list[Replica], list[str]]:
        """The replicas this policy governs, and why it leaves the others alone: of several
        policies that select a Pod, the oldest governs it, so none flaps between them."""
        policies = self.governors(namespace) if self.governors is not None else ()
        governed, contested = [], []
        for replica in selected:
            why = governing.contest(name, policies, dict(replica.labels), pod=replica.title)
            if why is None:
                governed.append(replica)
            else:
                contested.append(why)
        return governed, contested

    async def _act(
        self,
        namespace: str,
        policy: specs.BatchPolicySpec,
        decision: decisions.Decision,
        observed: _Observed,
        *,
        state: PolicyMemory,
        generation: int | None,
        now: datetime.datetime,
    ) -> canaries.Passed | None:
        if observed.survey.missing:
            return None  # the spec names models the fleet lacks: change nothing anywhere
        if observed.credential_problem is not None and not policy.dry_run:
            return None  # no credential: change nothing anywhere
        if policy.dry_run:
            await rollouts.open_gates_for_dry_run(observed.replicas, namespace, self.gates)
            return canaries.Passed(rollouts.dry_run(observed.replicas, observed.survey))
        plan = rollouts.Plan(
            namespace=namespace,
            profile=decision.profile,
            settings=decision.settings,
            rollout=policy.rollout,
            settle_seconds=self.settle_seconds,
        )
        # Timed by the policy's clock, which decisions and leads are in.
        started = self.clock()
        passed = await canaries.roll_out(
            rollouts.mark_restarted(observed.replicas, state.vouched),
            observed.survey,
            plan,
            self.fleet,
            self.gates,
            memory=state.canary,
            context=canaries.Context(
                canary=policy.rollout.canary,
                generation=generation,
                now=now,
                emergency=decision.memory.guard is not None,
                per_server=observed.reading.per_server,
                engines_per_server=observed.reading.engines_per_server,
                models=policy.target.models,
                objectives=canaries.objectives_of(policy),
            ),
        )
        seconds = (self.clock() - started).total_seconds()
        return dataclasses.replace(
            passed, result=dataclasses.replace(passed.result, seconds=seconds)
        )

    def _report(
        self,
        policy: telemetry.PolicyLabels,
        found: reporting.Findings,
        previous: statuses.BatchPolicyStatus,
        state: PolicyMemory,
        reading: sources.Reading | None = None,
    ) -> Reconciled:
        if found.policy is not None and found.decision is not None:
            telemetry.record_decision(
                self.metrics,
                policy,
                found.policy,
                found.decision,
                signals=reading.signals.metrics if reading else {},
                signals_missing=bool(found.signal_problems),
                lead_seconds=found.lead.lead.total_seconds() if found.lead else None,
            )
        if found.result is not None and not found.result.dry_run:
            telemetry.record_rollout(self.metrics, policy, found.result)
        telemetry.record_canary(self.metrics, policy, found.canary_notes)
        return Reconciled(
            at=found.now,
            status=reporting.status(found, previous),
            events=state.announce(reporting.notices(found)),
            wake_at=_wake_at(found.decision),
            decision=found.decision,
            rollout=found.result,
            reading=reading or sources.Reading(decisions.Signals()),
        )

    async def _signals(
        self,
        namespace: str,
        policy: specs.BatchPolicySpec,
        replicas: Sequence[Replica],
        state: PolicyMemory,
    ) -> sources.Reading:
        # Rules need signals; so does an objective (autotune, the guard and the SLO alert read
        # the measured p95) and a canary (it compares replicas by their figures).
        wanted = (
            bool(policy.load and policy.load.rules)
            or policy.slo is not None
            or policy.rollout.canary is not None
        )
        if not wanted:
            return sources.Reading(signals=decisions.Signals())
        prometheus = policy.load.prometheus.url if policy.load and policy.load.prometheus else ""
        source = policy.signal_source
        slo = policy.slo.model_dump_json() if policy.slo else ""
        key = (source, prometheus, slo, *(f"{r.http_url} {r.sidecar_url}" for r in replicas))
        if state.source is None or state.source_key != key:
            await state.close_source()
            state.source = self.signal_source(namespace, policy, replicas)
            state.source_key = key
        try:
            async with asyncio.timeout(SIGNAL_TIMEOUT_SECONDS):
                return await state.source.read()
        except TimeoutError:
            return sources.Reading(
                signals=decisions.Signals(),
                problems=(f"reading signals: no reading within {SIGNAL_TIMEOUT_SECONDS:g}s",),
            )
        except (servers.TritonError, OSError) as error:
            return sources.Reading(
                signals=decisions.Signals(), problems=(f"reading signals: {error}",)
            )
