"""Rollouts with a canary: new settings on a few replicas, judged by what they are for, then the
fleet or a rollback (`spec.rollout.canary`).

Which settings are new is remembered per settings hash (`rendering.settings_hash`), in memory
and in the status (`status.settings`), so a restarted operator knows them too:

- settings the whole fleet served (proven) roll straight on, so daily switches between proven
  profiles are never late for a canary; so do the SLO guard's emergency changes, and a policy's
  first rollout (nothing of batchpilot's to return to);
- settings that failed their canary are not tried again under the same spec generation: the
  fleet stays on the settings it served, and canary replicas return to them;
- other settings go to `canary.replicas` replicas first (Rolling); once all of them serve
  them, they are judged over `canary.analysisSeconds` (Analysing), from the per-replica figures
  of the policy's signal source, by `batchpilot.policy.verdicts`: an edit of the profile the
  fleet serves against the other replicas, a switch into another profile against that
  profile's own objectives (and the others' failures); then Promoted (the rest follow in the
  same pass), RolledBack, or Inconclusive (onInconclusive decides which of the two).

Every step is level-based like a plain rollout: a pass finds where the canary stands and moves
it on; the analysis window itself lives in memory, so a restarted operator starts it afresh.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from batchpilot.api.v1alpha1 import specs, statuses
from batchpilot.applying import rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering, verdicts
from batchpilot_triton import reports, scraping

PROVEN_REMEMBERED = 16
FAILED_REMEMBERED = 16
SERVED_DOCUMENT_CHARS = 16_384
"""The most of the served settings' JSON the status keeps (status.settings.served's bound)."""

EventType = Literal["Normal", "Warning"]
VerdictLabel = Literal["promoted", "rolled_back", "inconclusive"]
"""The `verdict` label of batchpilot_canary_verdicts_total."""


@dataclass(frozen=True)
class Note:
    """Something a pass did with a canary, for an event (and a verdict, for the counter)."""

    type: EventType
    reason: str
    message: str
    verdict: VerdictLabel | None = None


@dataclass
class Analysis:
    """One canary of one settings hash."""

    profile: str
    settings_hash: str
    replicas: tuple[str, ...]
    objectives: verdicts.Objectives | None = None
    """For a switch into another profile than the fleet serves: what its latency is judged by
    (the profile's own objectives); None for an edit, judged against the other replicas."""
    phase: statuses.CanaryPhase = "Rolling"
    started: datetime.datetime | None = None
    last_reading: datetime.datetime | None = None
    samples: list[verdicts.Sample] = field(default_factory=list)
    figures: verdicts.Figures | None = None
    reason: str = "the canary replicas take the settings"
    verdict_time: datetime.datetime | None = None

    def status(self) -> statuses.CanaryStatus:
        return statuses.CanaryStatus(
            profile=self.profile,
            settings_hash=self.settings_hash,
            replicas=list(self.replicas),
            phase=self.phase,
            started_at=self.started,
            figures=self.figures.describe() if self.figures else "",
            reason=self.reason[:1024],
            verdict_time=self.verdict_time,
        )


@dataclass(frozen=True)
class ServedSettings:
    """The profile and settings the whole fleet last served, with what the status keeps of
    them, computed once when they are recorded rather than on every pass."""

    profile: str
    settings: rendering.Settings
    settings_hash: str
    document: str
    """The settings as JSON; empty when longer than SERVED_DOCUMENT_CHARS (a profile with
    many priority levels): kept in memory only, so a restarted operator learns them again from
    its next full rollout instead of writing a status the API server refuses."""

    @classmethod
    def of(cls, profile: str, settings: rendering.Settings, settings_hash: str) -> ServedSettings:
        document = json.dumps(rendering.settings_document(settings), sort_keys=True)
        return cls(
            profile,
            settings,
            settings_hash,
            document if len(document) <= SERVED_DOCUMENT_CHARS else "",
        )


@dataclass
class CanaryMemory:
    """What the canary keeps of a policy between passes."""

    served: ServedSettings | None = None
    """What the whole fleet last served."""
    proven: list[str] = field(default_factory=list)
    failed: dict[str, statuses.FailedSettings] = field(default_factory=dict)
    analysis: Analysis | None = None
    resumed: bool = False

    def resume(self, previous: statuses.BatchPolicyStatus) -> None:
        """Carry on from the status a previous operator wrote."""
        if self.resumed:
            return
        self.resumed = True
        history = previous.settings
        if history is None:
            return
        self.proven = list(history.proven)
        self.failed = {entry.settings_hash: entry for entry in history.failed}
        if history.served and history.served_profile:
            try:
                settings = rendering.from_status(json.loads(history.served))
            except ValueError:
                settings = None
            if settings is None:
                return  # not ours to trust: the next full rollout records it again
            settings_hash = rendering.settings_hash(settings)
            self.served = ServedSettings.of(history.served_profile, settings, settings_hash)

    def history(self) -> statuses.SettingsHistory | None:
        if self.served is None and not self.proven and not self.failed:
            return None
        served = self.served
        return statuses.SettingsHistory(
            served_profile=served.profile if served else None,
            served_hash=served.settings_hash if served else None,
            served=served.document if served else "",
            proven=self.proven[-PROVEN_REMEMBERED:],
            failed=list(self.failed.values())[-FAILED_REMEMBERED:],
        )

    def prove(self, settings_hash: str) -> None:
        if settings_hash in self.proven:
            self.proven.remove(settings_hash)
        self.proven = [*self.proven, settings_hash][-PROVEN_REMEMBERED:]

    def record_served(self, profile: str, settings: rendering.Settings, settings_hash: str) -> None:
        served = self.served
        if served is None or (served.profile, served.settings_hash) != (profile, settings_hash):
            self.served = ServedSettings.of(profile, settings, settings_hash)
        self.prove(settings_hash)

    def failure(self, settings_hash: str) -> statuses.FailedSettings | None:
        return self.failed.get(settings_hash)

    def fail(self, failed: statuses.FailedSettings) -> None:
        self.failed[failed.settings_hash] = failed
        while len(self.failed) > FAILED_REMEMBERED:
            self.failed.pop(next(iter(self.failed)))


def leads_through_canary(policy: specs.BatchPolicySpec, memory: CanaryMemory) -> bool:
    """Whether a switch that starts before its boundary (into a latency profile) would go
    through a canary first: the canary is on, the fleet served something of batchpilot's, and
    a latency profile's settings are not proven (so `leadTime: auto` plans for the analysis)."""
    if policy.rollout.canary is None or memory.served is None:
        return False
    return any(
        rendering.settings_hash(rendering.render(profile)) not in memory.proven
        for name, profile in policy.profiles.items()
        if policy.profile_role(name) == "latency"
    )


@dataclass(frozen=True)
class Context:
    """One pass's facts the canary needs beyond the rollout's own."""

    canary: specs.Canary | None
    generation: int | None
    now: datetime.datetime
    emergency: bool
    """The SLO guard holds the queue delay down: its change must not wait."""
    per_server: Mapping[str, Mapping[str, scraping.ModelRates]]
    """The signal source's latest per-server figures, by the URL it reads each server at."""
    models: Collection[str]
    """The governed models (empty: every model a server serves)."""
    engines_per_server: Mapping[str, Mapping[str, reports.LlmReport]] = field(default_factory=dict)
    """What the LLM engines measured, by the same URLs."""
    objectives: Mapping[str, verdicts.Objectives] = field(default_factory=dict)
    """Each profile's own latency objectives (`objectives_of`), for switches into it."""


def objectives_of(policy: specs.BatchPolicySpec) -> dict[str, verdicts.Objectives]:
    """The SLO's objectives of every profile it governs; profiles it does not govern have none."""
    slo = policy.slo
    if slo is None:
        return {}
    return {
        name: verdicts.Objectives(
            p95_ms=slo.p95_latency_ms,
            ttft_p95_ms=slo.ttft_p95_ms,
            inter_token_p95_ms=slo.itl_p95_ms,
        )
        for name in policy.profiles
        if policy.slo_governs(name)
    }


@dataclass(frozen=True)
class Passed:
    result: rollouts.Result
    notes: tuple[Note, ...] = ()


async def roll_out(
    replicas: Sequence[Replica],
    survey: rollouts.Survey,
    plan: rollouts.Plan,
    fleet: rollouts.Fleet,
    gates: rollouts.Gates,
    *,
    memory: CanaryMemory,
    context: Context,
) -> Passed:
    """One pass of the rollout of `plan`, through a canary where its settings are new."""
    wanted = rendering.settings_hash(plan.settings)
    return await _Pass(replicas, survey, plan, wanted, fleet, gates, memory, context).run()


@dataclass
class _Pass:
    """One pass: the rollout's own arguments, and what the canary remembers and knows."""

    replicas: Sequence[Replica]
    survey: rollouts.Survey
    plan: rollouts.Plan
    wanted: str
    """The hash of the plan's settings."""
    fleet: rollouts.Fleet
    gates: rollouts.Gates
    memory: CanaryMemory
    context: Context

    async def run(self) -> Passed:
        memory, context = self.memory, self.context
        wanted = self.wanted
        _forget_failures_of_older_specs(memory, context.generation)
        if memory.failure(wanted) is not None and memory.served is not None:
            # The fleet stays on what it served; canary replicas on the failed settings return.
            return Passed(await self._back_to_served(self.replicas))
        spec = context.canary
        straight = spec is None or context.emergency or memory.served is None
        if straight or wanted in memory.proven:
            return Passed(await self._everywhere())
        assert spec is not None
        return await self._canary(spec, wanted)

    async def _roll(
        self, replicas: Sequence[Replica], plan: rollouts.Plan | None = None
    ) -> rollouts.Result:
        return await rollouts.roll_out(
            replicas, self.survey, plan or self.plan, self.fleet, self.gates
        )

    async def _everywhere(self) -> rollouts.Result:
        result = await self._roll(self.replicas)
        if result.outcomes and result.count("Updated") == len(result.outcomes):
            self.memory.record_served(self.plan.profile, self.plan.settings, self.wanted)
        return result

    async def _back_to_served(self, replicas: Sequence[Replica]) -> rollouts.Result:
        assert self.memory.served is not None, "a canary runs once the fleet served something"
        served = self.memory.served
        return await self._roll(
            replicas,
            dataclasses.replace(self.plan, profile=served.profile, settings=served.settings),
        )

    async def _canary(self, spec: specs.Canary, wanted: str) -> Passed:
        reachable = [r for r in self.replicas if r.name not in self.survey.unreachable]
        names = {replica.name for replica in reachable}
        analysis = self.memory.analysis
        if (
            analysis is None
            or analysis.settings_hash != wanted
            or analysis.phase in ("Promoted", "RolledBack", "Inconclusive")
            or not set(analysis.replicas) <= names
        ):
            chosen = tuple(sorted(names)[: spec.replicas])
            analysis = self.memory.analysis = Analysis(
                self.plan.profile, wanted, chosen, self._objectives()
            )
        if len(reachable) <= len(analysis.replicas):
            alone = (
                f"no replica to compare with: {len(reachable)} answer, the canary takes "
                f"{spec.replicas}"
            )
            return await self._conclude(spec, analysis, _unjudged("Inconclusive", alone, spec))
        canaries = [replica for replica in reachable if replica.name in analysis.replicas]
        trial = await self._roll(canaries)
        if analysis.phase == "Rolling":
            broken = [outcome for outcome in trial.outcomes if outcome.state == "Failed"]
            if broken:
                why = "; ".join(f"{o.replica.title}: {o.message}" for o in broken)
                refused = _unjudged("Rollback", f"the settings could not be applied: {why}", spec)
                return await self._conclude(spec, analysis, refused)
            if trial.count("Updated") < len(canaries):
                return Passed(self._others_waiting(trial, "the canary replicas take them"))
            analysis.phase = "Analysing"
            analysis.started = analysis.last_reading = self.context.now
            analysis.reason = "analysing"
            others = len(reachable) - len(canaries)
            if analysis.objectives is None:
                judged_by = f"compared with the other {others} replicas"
            else:
                judged_by = (
                    f"a switch from {self._served_profile()}: judged by {self.plan.profile}'s "
                    f"objectives ({analysis.objectives.describe()}) and the other {others} "
                    "replicas' failures"
                )
            started = Note(
                "Normal",
                "CanaryStarted",
                f"{self.plan.profile} settings {wanted} on {', '.join(analysis.replicas)}: "
                f"{judged_by} for {spec.analysis_seconds}s",
            )
            return Passed(self._others_waiting(trial, "waiting for the canary"), (started,))
        sample = _sample(reachable, analysis, self.context)
        if sample is not None:
            analysis.samples.append(sample)
            analysis.last_reading = self.context.now
        assert analysis.started is not None
        judged = verdicts.judge(
            analysis.samples,
            _limits(spec),
            analysis.started,
            self.context.now,
            analysis.objectives,
        )
        analysis.figures = judged.figures
        if judged.verdict is None:
            return Passed(self._others_waiting(trial, "waiting for the canary"))
        return await self._conclude(spec, analysis, judged)

    def _served_profile(self) -> str:
        assert self.memory.served is not None, "a canary runs once the fleet served something"
        return self.memory.served.profile

    def _objectives(self) -> verdicts.Objectives | None:
        """None for an edit of the profile the fleet serves; a switch's own objectives."""
        if self.plan.profile == self._served_profile():
            return None
        return self.context.objectives.get(self.plan.profile, verdicts.Objectives())

    async def _conclude(
        self, spec: specs.Canary, analysis: Analysis, judged: verdicts.Judgement
    ) -> Passed:
        analysis.figures = judged.figures
        analysis.verdict_time = self.context.now
        analysis.reason = judged.reason
        inconclusive = judged.verdict == "Inconclusive"
        promote = judged.verdict == "Promote" or (
            inconclusive and spec.on_inconclusive == "Promote"
        )
        analysis.phase = "Inconclusive" if inconclusive else "Promoted" if promote else "RolledBack"
        figures = f" ({judged.figures.describe()})" if judged.figures.canary_requests else ""
        subject = f"{analysis.profile} settings {analysis.settings_hash}"
        notes = []
        if inconclusive:
            then = "promoted" if promote else "rolled back"
            message = f"{subject}: {judged.reason}; {then}{figures}"
            notes.append(Note("Warning", "CanaryInconclusive", message, "inconclusive"))
        if promote:
            self.memory.prove(analysis.settings_hash)
            if not inconclusive:
                message = f"{subject}: promoted{figures}"
                notes.append(Note("Normal", "CanaryPromoted", message, "promoted"))
            return Passed(await self._everywhere(), tuple(notes))
        self.memory.fail(
            statuses.FailedSettings(
                settings_hash=analysis.settings_hash,
                profile=analysis.profile,
                generation=self.context.generation,
                reason=f"{judged.reason}{figures}"[:1024],
                failed_at=self.context.now,
            )
        )
        if not inconclusive:
            message = (
                f"{subject}: rolled back: {judged.reason}{figures}; not tried again until the "
                "spec changes"
            )
            notes.append(Note("Warning", "CanaryRolledBack", message, "rolled_back"))
        return Passed(await self._back_to_served(self.replicas), tuple(notes))

    def _others_waiting(self, trial: rollouts.Result, why: str) -> rollouts.Result:
        """The canary replicas' outcomes, and the rest's: pending, and why."""
        tried = {outcome.replica.name for outcome in trial.outcomes}
        waiting = [
            rollouts.Outcome(replica, "Pending", None, why)
            for replica in self.replicas
            if replica.name not in tried
        ]
        return dataclasses.replace(trial, outcomes=(*trial.outcomes, *waiting))


def _unjudged(verdict: verdicts.Verdict, reason: str, spec: specs.Canary) -> verdicts.Judgement:
    """A verdict reached before any reading: nothing to show for figures."""
    return verdicts.Judgement(verdict, reason, verdicts.figures([], _limits(spec)))


def _forget_failures_of_older_specs(memory: CanaryMemory, generation: int | None) -> None:
    memory.failed = {
        key: entry for key, entry in memory.failed.items() if entry.generation == generation
    }


def _limits(spec: specs.Canary) -> verdicts.Limits:
    return verdicts.Limits(
        analysis=datetime.timedelta(seconds=spec.analysis_seconds),
        min_requests=spec.min_requests,
        max_failure_rate=spec.max_failure_rate,
        max_p95_ratio=spec.max_p95_ratio,
        max_p99_ratio=spec.max_p99_ratio,
        max_ttft_p95_ratio=spec.max_ttft_p95_ratio,
        max_inter_token_p95_ratio=spec.max_inter_token_p95_ratio,
    )


def _sample(
    reachable: Sequence[Replica], analysis: Analysis, context: Context
) -> verdicts.Sample | None:
    """What each side served since the previous reading, from the source's per-server figures
    (each covers its own rate window, so its counts are prorated to the time since)."""
    assert analysis.last_reading is not None
    since = (context.now - analysis.last_reading).total_seconds()
    if since <= 0:
        return None
    canary = [_served(r, context, since) for r in reachable if r.name in analysis.replicas]
    baseline = [_served(r, context, since) for r in reachable if r.name not in analysis.replicas]
    assert analysis.started is not None
    analysed = (context.now - analysis.started).total_seconds()
    windows = [_window_seconds(r, context) for r in reachable if r.name in analysis.replicas]
    return verdicts.Sample(
        at=context.now,
        canary=_group([served for served in canary if served is not None]),
        baseline=_group([served for served in baseline if served is not None]),
        settled=all(seconds is not None and seconds <= analysed for seconds in windows),
    )


def _window_seconds(replica: Replica, context: Context) -> float | None:
    """How far back the source's figures of a replica reach (its longest rate window)."""
    key = _key_of(replica, context.per_server)
    if key is None:
        return None
    return max((rates.seconds for rates in context.per_server[key].values()), default=None)


def _served(replica: Replica, context: Context, since: float) -> verdicts.Served | None:
    """One replica's figures over its governed models; a quantile is its worst model's."""
    key = _key_of(replica, context.per_server)
    if key is None:
        return None

    def governed(model: str) -> bool:
        return not context.models or model in context.models

    chosen = [rates for model, rates in context.per_server[key].items() if governed(model)]
    if not chosen:
        return None
    engines = [
        report
        for model, report in context.engines_per_server.get(key, {}).items()
        if governed(model)
    ]
    share = min(1.0, since / max(rates.seconds for rates in chosen))

    def worst(values: Iterable[float | None]) -> float | None:
        return max((value for value in values if value is not None), default=None)

    return verdicts.Served(
        requests=share * sum(rates.counted.requests for rates in chosen),
        failures=share * sum(rates.counted.requests_failed for rates in chosen),
        pending=sum(rates.pending for rates in chosen),
        p95_ms=worst(rates.p95_ms for rates in chosen),
        p99_ms=worst(rates.p99_ms for rates in chosen),
        ttft_p95_ms=worst(report.ttft_p95_ms for report in engines),
        inter_token_p95_ms=worst(report.inter_token_p95_ms for report in engines),
    )


def _key_of(
    replica: Replica, per_server: Mapping[str, Mapping[str, scraping.ModelRates]]
) -> str | None:
    """The URL the source reads a replica's figures at: its sidecar's, or Triton's."""
    keys = [f"http://{replica.endpoint}"]
    if replica.sidecar_url:
        keys.insert(0, replica.sidecar_url.rstrip("/"))
    return next((key for key in keys if key in per_server), None)


def _group(served: Sequence[verdicts.Served]) -> verdicts.Served:
    """One side's figures: counts add up; a quantile is the median replica's, so one odd replica
    of the baseline does not move the comparison."""

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return verdicts.Served(
        requests=sum(s.requests for s in served),
        failures=sum(s.failures for s in served),
        replicas=len(served),
        pending=sum(s.pending for s in served),
        p95_ms=median([s.p95_ms for s in served if s.p95_ms is not None]),
        p99_ms=median([s.p99_ms for s in served if s.p99_ms is not None]),
        ttft_p95_ms=median([s.ttft_p95_ms for s in served if s.ttft_p95_ms is not None]),
        inter_token_p95_ms=median(
            [s.inter_token_p95_ms for s in served if s.inter_token_p95_ms is not None]
        ),
    )
