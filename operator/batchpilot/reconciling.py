"""One reconcile of one BatchPolicy: discover, measure, decide, roll out, report.

The operator's handlers call `Reconciler.reconcile` on every tick of a policy's daemon, with the
policy's current body. Everything it learns goes into the returned status and events; it keeps
only the decision engine's memory (and the signal source, whose rates need the previous
scrape) between calls. Nothing here knows kopf, so it is tested with fakes at the Kubernetes
and Triton boundaries.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from batchpilot import telemetry
from batchpilot.applying import rollouts
from batchpilot.kube.pods import Target
from batchpilot.policy import decisions, documents, specs, statuses
from batchpilot.signals import sources
from batchpilot_triton import servers

logger = logging.getLogger("batchpilot.operator")

MAX_TARGET_DETAILS = 64
SIGNAL_TIMEOUT_SECONDS = 5.0


class PodSource(Protocol):
    async def targets(
        self, namespace: str, target: specs.Target
    ) -> tuple[list[Target], list[str]]: ...


class SignalSource(Protocol):
    async def read(self) -> sources.Reading: ...

    async def close(self) -> None: ...


SignalSourceFactory = Callable[[str, specs.BatchPolicySpec, Sequence[Target]], SignalSource]
"""Builds the signal source for (namespace, policy, targets)."""


class Fleet(rollouts.Fleet, Protocol):
    def server(self, url: str) -> servers.TritonServer: ...

    async def forget_all_but(self, urls: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class PolicyMemory:
    """What the operator keeps about one policy between reconciles, in memory only."""

    memory: decisions.Memory = field(default_factory=decisions.Memory)
    source: SignalSource | None = None
    source_key: tuple[str, ...] = ()
    announced: dict[str, str] = field(default_factory=dict)
    """Last message per event key, so a standing problem is reported once, not every tick."""

    def announce(self, key: str, event: Event, into: list[Event]) -> None:
        if self.announced.get(key) != event.message:
            self.announced[key] = event.message
            into.append(event)

    def forget(self, key: str) -> None:
        self.announced.pop(key, None)

    async def close_source(self) -> None:
        if self.source is not None:
            source, self.source = self.source, None
            await source.close()


@dataclass(frozen=True)
class Reconciled:
    status: dict[str, Any]
    events: tuple[Event, ...]
    wake_at: datetime.datetime | None
    decision: decisions.Decision | None = None
    rollout: rollouts.Result | None = None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _stamp(instant: datetime.datetime | None) -> str | None:
    if instant is None:
        return None
    return instant.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_stamp(text: object) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


class Reconciler:
    def __init__(
        self,
        *,
        pods: PodSource,
        gates: rollouts.Gates,
        fleet: Fleet,
        signal_source: SignalSourceFactory,
        metrics: telemetry.ControllerMetrics,
        clock: Callable[[], datetime.datetime] = _now,
        settle_seconds: float = 1.5,
    ) -> None:
        self.pods = pods
        self.gates = gates
        self.fleet = fleet
        self.signal_source = signal_source
        self.metrics = metrics
        self.clock = clock
        self.settle_seconds = settle_seconds
        # The fleet's clients are shared by every policy: a client is closed only once no
        # policy targets its server, never because another policy's targets changed.
        self._targets: dict[tuple[str, str], frozenset[str]] = {}

    def forget_policy(self, namespace: str, name: str) -> None:
        """The policy is gone: its servers no longer keep their clients open."""
        self._targets.pop((namespace, name), None)

    async def reconcile(
        self,
        *,
        namespace: str,
        name: str,
        spec: Mapping[str, Any],
        status: Mapping[str, Any],
        generation: int | None,
        state: PolicyMemory,
    ) -> Reconciled:
        now = self.clock()
        events: list[Event] = []
        # Status times are whole seconds; decisions (dwell, for) keep the precise time.
        report = _Report(now=now.replace(microsecond=0), previous=status, generation=generation)
        try:
            policy = documents.parse_spec(dict(spec))
        except documents.PolicyError as error:
            message = "; ".join(str(problem) for problem in error.problems)
            state.announce("InvalidSpec", Event("Warning", "InvalidSpec", message), events)
            return Reconciled(report.invalid(message), tuple(events), None)
        state.forget("InvalidSpec")
        if state.memory.profile is None and status.get("activeProfile") in policy.profiles:
            # A restarted operator carries on from the status: no switch, dwell respected.
            state.memory = decisions.Memory(
                profile=str(status["activeProfile"]),
                since=_parse_stamp(status.get("lastTransitionTime")),
            )

        targets, skipped = await self.pods.targets(namespace, policy.target)
        self._targets[(namespace, name)] = frozenset(target.http_url for target in targets)
        await self.fleet.forget_all_but(sorted(frozenset().union(*self._targets.values())))
        models, unreachable, missing = await self._models(targets, policy)
        for target in targets:
            key = f"unreachable/{target.name}"
            if target.name in unreachable:
                message = f"pod {target.name}: {unreachable[target.name]}"
                state.announce(key, Event("Warning", "TargetUnreachable", message), events)
            else:
                state.forget(key)
        reading = await self._signals(namespace, policy, targets, state)
        decision = decisions.decide(policy, now, reading.signals, state.memory)
        previous_profile = state.memory.profile
        state.memory = decision.memory
        self._record(name, policy, decision, reading)
        if decision.switched:
            event = Event(
                "Normal",
                "DryRunDecision" if policy.dry_run else "ProfileSwitched",
                f"{previous_profile or '(none)'} -> {decision.profile}: {decision.reason}",
            )
            events.append(event)
            logger.info("%s/%s: %s", namespace, name, event.message)

        if missing:
            message = "; ".join(missing)
            state.announce("InvalidSpec", Event("Warning", "InvalidSpec", message), events)
            return Reconciled(
                report.invalid(message, decision=decision), tuple(events), decision.next_transition
            )
        if policy.dry_run:
            await self._open_gates_for_dry_run(namespace, targets)
            return Reconciled(
                report.decided(policy, decision, targets, None, reading, skipped, unreachable),
                tuple(events),
                decision.next_transition,
                decision,
            )

        plan = rollouts.Plan(
            namespace=namespace,
            profile=decision.profile,
            settings=decision.settings,
            models=models,
            rollout=policy.rollout,
            settle_seconds=self.settle_seconds,
        )
        reachable = [target for target in targets if target.http_url in models]
        result = await rollouts.roll_out(reachable, plan, self.fleet, self.gates)
        self._rollout_events(name, result, decision, state, events)
        self._count_targets(name, result, unreachable)
        return Reconciled(
            report.decided(policy, decision, targets, result, reading, skipped, unreachable),
            tuple(events),
            decision.next_transition,
            decision,
            result,
        )

    async def _models(
        self, targets: Sequence[Target], policy: specs.BatchPolicySpec
    ) -> tuple[dict[str, list[str]], dict[str, str], list[str]]:
        """Models per reachable target, unreachable targets, and models a target lacks."""
        models: dict[str, list[str]] = {}
        unreachable: dict[str, str] = {}
        missing: list[str] = []

        async def one(target: Target) -> None:
            try:
                loaded = await self.fleet.loaded_models(target.http_url)
            except servers.TritonError as error:
                unreachable[target.name] = error.message
                return
            wanted = policy.target.models or loaded
            lacking = [model for model in wanted if model not in loaded]
            if lacking:
                missing.append(
                    f"spec.target.models: {', '.join(repr(m) for m in lacking)} not loaded on "
                    f"pod {target.name} (it has: {', '.join(loaded) or 'no models'})"
                )
            models[target.http_url] = list(wanted)

        await asyncio.gather(*(one(target) for target in targets))
        return models, unreachable, sorted(missing)

    async def _signals(
        self,
        namespace: str,
        policy: specs.BatchPolicySpec,
        targets: Sequence[Target],
        state: PolicyMemory,
    ) -> sources.Reading:
        wanted = bool(policy.load and policy.load.rules) or bool(policy.slo and policy.slo.autotune)
        if not wanted:
            return sources.Reading(signals=decisions.Signals())
        prometheus = policy.load.prometheus.url if policy.load and policy.load.prometheus else ""
        source = policy.load.source if policy.load else "sidecar"
        slo = policy.slo.model_dump_json() if policy.slo else ""
        key = (source, prometheus, slo, *(f"{t.http_url} {t.sidecar_url}" for t in targets))
        if state.source is None or state.source_key != key:
            await state.close_source()
            state.source = self.signal_source(namespace, policy, targets)
            state.source_key = key
        try:
            async with asyncio.timeout(SIGNAL_TIMEOUT_SECONDS):
                return await state.source.read()
        except (TimeoutError, servers.TritonError, OSError) as error:
            return sources.Reading(
                signals=decisions.Signals(), problems=(f"reading signals: {error}",)
            )

    async def _open_gates_for_dry_run(self, namespace: str, targets: Sequence[Target]) -> None:
        """A dry run changes no Triton server, but must not keep gated Pods out of service."""
        for target in targets:
            if target.gated and target.gate != "True":
                await self.gates.set_gate(
                    namespace,
                    target.name,
                    applied=True,
                    reason="DryRun",
                    message="batchpilot runs this policy as a dry run",
                )

    def _record(
        self,
        name: str,
        policy: specs.BatchPolicySpec,
        decision: decisions.Decision,
        reading: sources.Reading,
    ) -> None:
        metrics = self.metrics
        telemetry.count_from_zero(
            metrics, name, profiles=policy.profiles, reasons=telemetry.OPERATOR_APPLY_ERRORS
        )
        if decision.switched:
            metrics.switches.labels(name, decision.profile).inc()
        metrics.decisions.labels(name, decision.source).inc()
        for profile in policy.profiles:
            metrics.active_profile.labels(name, profile).set(profile == decision.profile)
        metrics.queue_delay.labels(name).set(
            decision.settings.dynamic_batching["max_queue_delay_microseconds"]
        )
        upcoming = decision.next_transition
        metrics.next_transition.labels(name).set(upcoming.timestamp() if upcoming else 0)
        for metric, value in reading.signals.metrics.items():
            metrics.signal.labels(name, metric).set(value)
        unavailable = bool(reading.problems or _missing_metrics(policy, reading))
        metrics.signals_unavailable.labels(name).set(unavailable)
        telemetry.set_objective(metrics, name, policy, decision.profile)
        telemetry.set_roles(metrics, name, policy)

    def _count_targets(
        self, name: str, result: rollouts.Result, unreachable: Mapping[str, str]
    ) -> None:
        counts = {
            "updated": result.count("Updated"),
            "pending": result.count("Pending"),
            "failed": result.count("Failed"),
            "unreachable": result.count("Unreachable") + len(unreachable),
        }
        for state, count in counts.items():
            self.metrics.targets.labels(name, state).set(count)

    def _rollout_events(
        self,
        name: str,
        result: rollouts.Result,
        decision: decisions.Decision,
        state: PolicyMemory,
        events: list[Event],
    ) -> None:
        for outcome in result.outcomes:
            key = f"target/{outcome.target.name}"
            if outcome.state in ("Failed", "Unreachable"):
                reason = "RolledBack" if outcome.rolled_back else "ApplyFailed"
                message = f"pod {outcome.target.name}: {outcome.message}"
                state.announce(key, Event("Warning", reason, message), events)
                self.metrics.apply_errors.labels(name, reason).inc()
            else:
                state.forget(key)
        reloaded = sum(outcome.reloads for outcome in result.outcomes)
        if reloaded and result.count("Updated") == len(result.outcomes):
            events.append(
                Event(
                    "Normal",
                    "RolledOut",
                    f"{decision.profile} on {len(result.outcomes)}/{len(result.outcomes)} "
                    f"targets in {result.seconds:.1f}s ({reloaded} reloads)",
                )
            )


@dataclass(frozen=True)
class _Report:
    """Builds the status from what a reconcile found."""

    now: datetime.datetime
    previous: Mapping[str, Any]
    generation: int | None

    def _conditions(self, wanted: Mapping[str, tuple[bool, str, str]]) -> list[dict[str, Any]]:
        before = {c.get("type"): c for c in self.previous.get("conditions") or []}
        conditions = []
        for kind, (holds, reason, message) in wanted.items():
            status = "True" if holds else "False"
            earlier = before.get(kind, {})
            changed = earlier.get("status") != status
            conditions.append(
                statuses.Condition(
                    type=kind,
                    status=status,
                    reason=reason,
                    message=message[:4096],
                    last_transition_time=self.now
                    if changed
                    else _parse_stamp(earlier.get("lastTransitionTime")) or self.now,
                    observed_generation=self.generation,
                ).model_dump(by_alias=True, mode="json", exclude_none=True)
            )
        return conditions

    def invalid(
        self, message: str, *, decision: decisions.Decision | None = None
    ) -> dict[str, Any]:
        status = dict(self.previous)
        status.pop("conditions", None)
        status["reason"] = f"invalid spec: {message}"[:1024]
        status["observedGeneration"] = self.generation
        if decision is not None:
            status["desiredProfile"] = decision.desired_profile
        status["conditions"] = self._conditions(
            {
                "Ready": (False, "InvalidSpec", "the spec cannot be applied; nothing was changed"),
                "InvalidSpec": (True, "InvalidSpec", message),
                "Progressing": (False, "InvalidSpec", ""),
                "Degraded": (False, "InvalidSpec", ""),
                "SignalsUnavailable": (False, "InvalidSpec", ""),
            }
        )
        return _json(status)

    def decided(
        self,
        policy: specs.BatchPolicySpec,
        decision: decisions.Decision,
        targets: Sequence[Target],
        result: rollouts.Result | None,
        reading: sources.Reading,
        skipped: Sequence[str],
        unreachable: Mapping[str, str],
    ) -> dict[str, Any]:
        details: list[statuses.TargetStatus] = []
        by_name = {o.target.name: o for o in result.outcomes} if result else {}
        earlier = {d.get("name"): d for d in self.previous.get("targetDetails") or []}

        def since(name: str, state: str, message: str) -> datetime.datetime:
            """The state's start: unchanged details keep their time, so status stays still."""
            before = earlier.get(name, {})
            if before.get("state") == state and before.get("message", "") == message:
                return _parse_stamp(before.get("lastUpdateTime")) or self.now
            return self.now

        for target in targets:
            outcome = by_name.get(target.name)
            if outcome is not None:
                details.append(
                    statuses.TargetStatus(
                        name=target.name,
                        endpoint=target.endpoint,
                        profile=outcome.profile,
                        state=outcome.state,
                        message=outcome.message[:1024],
                        last_update_time=since(target.name, outcome.state, outcome.message[:1024]),
                    )
                )
            elif target.name in unreachable:
                details.append(
                    statuses.TargetStatus(
                        name=target.name,
                        endpoint=target.endpoint,
                        state="Unreachable",
                        message=unreachable[target.name][:1024],
                        last_update_time=since(
                            target.name, "Unreachable", unreachable[target.name][:1024]
                        ),
                    )
                )
            else:  # a dry run
                details.append(
                    statuses.TargetStatus(
                        name=target.name,
                        endpoint=target.endpoint,
                        state="Pending",
                        message="dry run: nothing applied",
                        last_update_time=self.now,
                    )
                )
        total = len(targets)
        updated = sum(d.state == "Updated" for d in details)
        failed = sum(d.state in ("Failed", "Unreachable") for d in details)
        summary = f"{updated}/{total} updated" + (f", {failed} failed" if failed else "")
        if policy.dry_run:
            summary = f"dry run, {total} targets"
        missing_metrics = _missing_metrics(policy, reading)
        signal_problems = [*reading.problems, *missing_metrics]
        ready = not policy.dry_run and total > 0 and updated == total
        if policy.dry_run:
            ready_reason, ready_message = "DryRun", "decisions are reported, nothing is applied"
        elif total == 0:
            ready_reason = "NoTargets"
            ready_message = "no Running Pod with an IP matches spec.target.selector"
            if skipped:
                ready_message += f" ({'; '.join(skipped)})"
        elif ready:
            ready_reason, ready_message = "RolledOut", f"{decision.profile} on every target"
        else:
            ready_reason, ready_message = "NotAllUpdated", summary
        holding = decision.desired_profile != decision.profile
        pending = sum(d.state == "Pending" for d in details)
        conditions = self._conditions(
            {
                "Ready": (ready, ready_reason, ready_message),
                "Progressing": (
                    holding or pending > 0,
                    "DwellHolding" if holding else ("RolloutPending" if pending else "Stable"),
                    decision.reason
                    if holding
                    else (f"{pending} targets pending" if pending else ""),
                ),
                "Degraded": (
                    failed > 0,
                    "TargetsFailed" if failed else "AllHealthy",
                    "; ".join(
                        f"{d.name}: {d.message}"
                        for d in details
                        if d.state in ("Failed", "Unreachable")
                    ),
                ),
                "InvalidSpec": (False, "Valid", ""),
                "SignalsUnavailable": (
                    bool(signal_problems),
                    "SignalsMissing" if signal_problems else "SignalsAvailable",
                    "; ".join(signal_problems)
                    + (
                        "; load rules keep their last state, then the schedule decides"
                        if signal_problems
                        else ""
                    ),
                ),
            }
        )
        previous_active = self.previous.get("activeProfile")
        switched = previous_active != decision.profile
        last_transition = (
            self.now
            if switched
            else _parse_stamp(self.previous.get("lastTransitionTime")) or decision.memory.since
        )
        status = statuses.BatchPolicyStatus(
            active_profile=decision.profile,
            desired_profile=decision.desired_profile,
            reason=decision.reason[:1024],
            last_transition_time=last_transition,
            next_transition_time=decision.next_transition,
            targets=statuses.TargetCounts(
                total=total, updated=updated, failed=failed, summary=summary
            ),
            target_details=details[:MAX_TARGET_DETAILS],
            observed_generation=self.generation,
        ).model_dump(by_alias=True, mode="json", exclude_none=True)
        status["conditions"] = conditions
        # A merge patch keeps fields it does not mention; clear what no longer applies.
        status.setdefault("nextTransitionTime", None)
        return _json(status)


def _missing_metrics(policy: specs.BatchPolicySpec, reading: sources.Reading) -> list[str]:
    rules = policy.load.rules if policy.load else []
    missing = sorted({rule.metric for rule in rules} - set(reading.signals.metrics))
    return [f"no {metric} measurement" for metric in missing]


def _json(status: Mapping[str, Any]) -> dict[str, Any]:
    """Timestamps as the API's RFC 3339 seconds; everything else as it is."""
    rendered: dict[str, Any] = {}
    for key, value in status.items():
        if isinstance(value, datetime.datetime):
            value = _stamp(value)
        rendered[key] = value
    return rendered
