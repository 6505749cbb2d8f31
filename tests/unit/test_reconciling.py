"""One reconcile of one policy, with fakes at the Kubernetes and Triton boundaries."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

import pytest
from operator_fakes import FakeFleet, FakeGates, FakePods, FakeServer, target

from batchpilot import reconciling, telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying.replicas import Replica, ServingContainer
from batchpilot.policy import decisions, governing
from batchpilot.signals import sources
from builders import market_hours, ny, spec_document, utc

NOW = utc(2026, 11, 24, 15)


class FixedSignals:
    def __init__(self, metrics: dict[str, float], problems: tuple[str, ...] = ()) -> None:
        self.reading = sources.Reading(decisions.Signals(metrics), problems=problems)

        self.closed = False

    async def read(self) -> sources.Reading:
        return self.reading

    async def close(self) -> None:
        self.closed = True


def reconciler(
    targets: list[Replica],
    fleet: FakeFleet,
    gates: FakeGates | None = None,
    signals: FixedSignals | None = None,
    now: datetime.datetime = NOW,
) -> reconciling.Reconciler:
    return reconciling.Reconciler(
        replicas=FakePods(targets),
        gates=gates or FakeGates(),
        fleet=fleet,
        signal_source=lambda namespace, policy, found: signals or FixedSignals({}),
        metrics=telemetry.controller_metrics(),
        clock=lambda: now,
        settle_seconds=0,
    )


async def reconcile(
    subject: reconciling.Reconciler,
    spec: dict[str, Any],
    *,
    status: dict[str, Any] | None = None,
    state: reconciling.PolicyMemory | None = None,
    progress: reconciling.StatusProgress | None = None,
) -> reconciling.Reconciled:
    return await subject.reconcile(
        namespace="ns",
        name="fleet",
        spec=spec,
        status=status or {},
        generation=3,
        state=state or reconciling.PolicyMemory(),
        progress=progress,
    )


def gauge(subject: reconciling.Reconciler, name: str) -> float | None:
    return subject.metrics.registry.get_sample_value(
        name, {"policy_namespace": "ns", "policy": "fleet"}
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def two_servers(**server: Any) -> tuple[list[Replica], FakeFleet]:
    targets = [target("triton-0"), target("triton-1")]
    return targets, FakeFleet({t.http_url: FakeServer(**server) for t in targets})


@pytest.mark.looptime
async def test_first_reconcile_switches_rolls_out_and_reports() -> None:
    targets, fleet = two_servers()
    outcome = await reconcile(reconciler(targets, fleet), spec_document())
    status = outcome.status
    assert status["activeProfile"] == "bulk"
    assert status["desiredProfile"] == "bulk"
    assert status["targets"] == {"total": 2, "updated": 2, "failed": 0, "summary": "2/2 updated"}
    assert status["observedGeneration"] == 3
    assert status["lastTransitionTime"] == "2026-11-24T15:00:00Z"
    assert conditions(status)["Ready"] == ("True", "RolledOut")
    assert conditions(status)["InvalidSpec"] == ("False", "Valid")
    assert [(e.reason, e.message) for e in outcome.events] == [
        ("ProfileSwitched", "(none) -> bulk: defaultProfile (no schedule windows)"),
        ("RolledOut", "bulk on 2/2 targets in 0.0s (2 reloads)"),
    ]
    assert all(server.profile == "bulk" for server in fleet.servers.values())


class Interim:
    """Records each status written while a pass runs, with what the fleet served then."""

    def __init__(self, fleet: FakeFleet) -> None:
        self.fleet = fleet
        self.written: list[tuple[dict[str, Any], list[str | None]]] = []

    async def __call__(self, status: dict[str, Any]) -> None:
        served = [server.profile for server in self.fleet.servers.values()]
        self.written.append((status, served))


@pytest.mark.looptime
async def test_a_rollout_to_a_new_profile_is_in_the_status_before_it_starts() -> None:
    """A rollout may take minutes (a load's timeout per replica): a new policy must not show
    nothing until it ends, and a switch says it is under way."""
    targets, fleet = two_servers()
    interim = Interim(fleet)
    state = reconciling.PolicyMemory()
    first = await reconcile(
        reconciler(targets, fleet), spec_document(), state=state, progress=interim
    )
    ((written, served),) = interim.written
    assert served == [None, None], "written before the first reload"
    assert "activeProfile" not in written, "nothing is in force yet"
    assert written["desiredProfile"] == "bulk"
    assert written["observedGeneration"] == 3
    assert conditions(written) == {
        "Progressing": ("True", "RollingOut"),
        "Ready": ("False", "RollingOut"),
    }
    progressing = next(c for c in written["conditions"] if c["type"] == "Progressing")
    assert progressing["message"] == "rolling out bulk to 2 targets, 1 at a time"
    assert conditions(first.status)["Progressing"] == ("False", "Stable")
    assert conditions(first.status)["Ready"] == ("True", "RolledOut")

    steady = reconciler(targets, fleet, now=NOW + datetime.timedelta(seconds=30))
    await reconcile(steady, spec_document(), status=first.status, state=state, progress=interim)
    assert len(interim.written) == 1, "a pass that switches nothing writes no interim status"

    later = NOW + datetime.timedelta(minutes=5)
    switch = reconciler(targets, fleet, now=later)
    spec = spec_document(defaultProfile="interactive")
    second = await reconcile(switch, spec, status=first.status, state=state, progress=interim)
    written, served = interim.written[-1]
    assert served == ["bulk", "bulk"]
    assert written["activeProfile"] == "bulk", "in force until the rollout ends"
    assert written["desiredProfile"] == "interactive"
    assert conditions(written)["Progressing"] == ("True", "RollingOut")
    assert conditions(written)["Ready"] == ("True", "RolledOut"), "the rest stays as it was"
    assert written["targets"] == first.status["targets"]
    assert second.status["activeProfile"] == "interactive"
    assert conditions(second.status)["Progressing"] == ("False", "Stable")
    moved = next(c for c in second.status["conditions"] if c["type"] == "Progressing")
    assert moved["lastTransitionTime"] == "2026-11-24T15:05:00Z", "it was True in between"


@pytest.mark.looptime
async def test_no_interim_status_for_a_dry_run_or_a_spec_that_cannot_apply() -> None:
    targets, fleet = two_servers()
    interim = Interim(fleet)
    await reconcile(reconciler(targets, fleet), spec_document(dryRun=True), progress=interim)
    lacking = spec_document(
        target={"selector": {"matchLabels": {"app": "triton"}}, "models": ["gpu_sim", "absent"]}
    )
    await reconcile(reconciler(targets, fleet), lacking, progress=interim)
    assert interim.written == []


@pytest.mark.looptime
async def test_invalid_spec_changes_nothing_and_is_reported_once() -> None:
    targets, fleet = two_servers()
    subject = reconciler(targets, fleet)
    state = reconciling.PolicyMemory()
    spec = spec_document(schedule={"timezone": "Mars/Olympus"})
    first = await reconcile(subject, spec, state=state)
    assert conditions(first.status)["InvalidSpec"] == ("True", "InvalidSpec")
    assert "spec.schedule.timezone: unknown time zone 'Mars/Olympus'" in first.status["reason"]
    assert [e.reason for e in first.events] == ["InvalidSpec"]
    second = await reconcile(subject, spec, status=first.status, state=state)
    assert second.events == ()
    assert fleet.calls == []


@pytest.mark.looptime
async def test_a_model_the_servers_lack_is_an_invalid_spec() -> None:
    targets, fleet = two_servers()
    spec = spec_document(
        target={"selector": {"matchLabels": {"app": "triton"}}, "models": ["gpu_sim", "torch_mlp"]}
    )
    outcome = await reconcile(reconciler(targets, fleet), spec)
    invalid = next(c for c in outcome.status["conditions"] if c["type"] == "InvalidSpec")
    assert invalid["message"].startswith(
        "spec.target.models: 'torch_mlp' not loaded on pod triton-0 (it has: gpu_sim)"
    )
    assert all(server.profile is None for server in fleet.servers.values())


@pytest.mark.looptime
async def test_restarted_operator_carries_on_from_the_status_without_a_switch() -> None:
    targets, fleet = two_servers(profile="interactive")
    status = {"activeProfile": "interactive", "lastTransitionTime": "2026-11-24T14:58:00Z"}
    # The schedule now asks for bulk, but interactive began two minutes ago and dwell is 5.
    spec = spec_document(minDwellSeconds=300)
    outcome = await reconcile(reconciler(targets, fleet), spec, status=status)
    assert outcome.status["activeProfile"] == "interactive"
    assert outcome.status["desiredProfile"] == "bulk"
    assert outcome.status["lastTransitionTime"] == "2026-11-24T14:58:00Z"
    assert conditions(outcome.status)["Progressing"] == ("True", "DwellHolding")
    assert outcome.wake_at == utc(2026, 11, 24, 15, 3)
    assert not any(e.reason == "ProfileSwitched" for e in outcome.events)
    assert fleet.calls == []


@pytest.mark.looptime
async def test_missing_signals_are_a_condition_and_the_schedule_decides() -> None:
    targets, fleet = two_servers()
    spec = spec_document(
        load={"rules": [{"profile": "interactive", "metric": "queueDepth", "above": 10}]}
    )
    signals = FixedSignals({}, problems=("sidecar 10.88.0.1:9400 unreachable",))
    subject = reconciler(targets, fleet, signals=signals)
    outcome = await reconcile(subject, spec)
    assert outcome.status["activeProfile"] == "bulk"
    assert gauge(subject, "batchpilot_signals_unavailable") == 1
    unavailable = next(c for c in outcome.status["conditions"] if c["type"] == "SignalsUnavailable")
    assert unavailable["status"] == "True"
    assert "sidecar 10.88.0.1:9400 unreachable" in unavailable["message"]
    assert "no queueDepth measurement" in unavailable["message"]


@pytest.mark.looptime
async def test_load_signal_switches_the_profile() -> None:
    targets, fleet = two_servers()
    spec = spec_document(
        load={"rules": [{"profile": "interactive", "metric": "queueDepth", "above": 10}]}
    )
    subject = reconciler(targets, fleet, signals=FixedSignals({"queueDepth": 50}))
    outcome = await reconcile(subject, spec)
    assert outcome.status["activeProfile"] == "interactive"
    assert outcome.status["reason"].startswith("load rule #1 (queueDepth > 10) holds")
    assert gauge(subject, "batchpilot_signals_unavailable") == 0


@pytest.mark.looptime
async def test_llm_engine_rules_show_in_the_status_and_their_signals_are_exported() -> None:
    rules = [
        {"profile": "interactive", "metric": "ttftP95Ms", "above": 1500},
        {"profile": "interactive", "metric": "waitingSequences", "above": 16, "below": 4},
    ]
    targets, fleet = two_servers()
    engine = FixedSignals({"ttftP95Ms": 900, "waitingSequences": 30})
    subject = reconciler(targets, fleet, signals=engine)
    outcome = await reconcile(subject, spec_document(load={"rules": rules}))
    assert outcome.status["activeProfile"] == "interactive"
    assert outcome.status["reason"] == (
        "load rule #2 (waitingSequences > 16) holds: lets go once waitingSequences < 4"
    )
    labels = {"policy_namespace": "ns", "policy": "fleet", "metric": "ttftP95Ms"}
    assert subject.metrics.registry.get_sample_value("batchpilot_signal", labels) == 900
    assert conditions(outcome.status)["SignalsUnavailable"] == ("False", "SignalsAvailable")

    targets, fleet = two_servers()
    classic = reconciler(targets, fleet, signals=FixedSignals({"queueDepth": 3}))
    outcome = await reconcile(classic, spec_document(load={"rules": rules}))
    assert outcome.status["activeProfile"] == "bulk"
    unavailable = next(c for c in outcome.status["conditions"] if c["type"] == "SignalsUnavailable")
    assert unavailable["status"] == "True"
    assert unavailable["message"].startswith(
        "no ttftP95Ms measurement; no waitingSequences measurement;"
    )


@pytest.mark.looptime
async def test_counters_are_exported_from_zero_so_rates_see_the_first_event() -> None:
    targets, fleet = two_servers()
    subject = reconciler(targets, fleet)
    await reconcile(subject, spec_document())
    registry = subject.metrics.registry
    for reason in telemetry.APPLY_ERRORS_BY:
        labels = {"policy_namespace": "ns", "policy": "fleet", "reason": reason}
        assert registry.get_sample_value("batchpilot_apply_errors_total", labels) == 0
    labels = {"policy_namespace": "ns", "policy": "fleet", "profile": "interactive"}
    assert registry.get_sample_value("batchpilot_profile_switches_total", labels) == 0


@pytest.mark.looptime
async def test_latency_objective_is_exported_only_while_it_governs_the_profile() -> None:
    targets, fleet = two_servers()
    slo = {"p95LatencyMs": 50, "profiles": ["interactive"]}
    subject = reconciler(targets, fleet)
    state = reconciling.PolicyMemory()
    await reconcile(subject, spec_document(slo=slo, defaultProfile="interactive"), state=state)
    assert gauge(subject, "batchpilot_slo_p95_latency_seconds") == 0.05
    await reconcile(subject, spec_document(slo=slo, defaultProfile="bulk"), state=state)
    assert gauge(subject, "batchpilot_slo_p95_latency_seconds") is None


@pytest.mark.looptime
async def test_dry_run_applies_nothing_but_opens_gates() -> None:
    gated = target("triton-0", gated=True)
    fleet = FakeFleet({gated.http_url: FakeServer()})
    gates = FakeGates()
    outcome = await reconcile(reconciler([gated], fleet, gates), spec_document(dryRun=True))
    assert outcome.status["activeProfile"] == "bulk"
    assert outcome.status["targets"]["summary"] == "dry run, 1 targets"
    assert conditions(outcome.status)["Ready"] == ("False", "DryRun")
    assert [e.reason for e in outcome.events] == ["DryRunDecision"]
    assert gates.changes == [("triton-0", True, "DryRun")]
    assert fleet.calls == []


@pytest.mark.looptime
async def test_no_targets_is_not_ready_and_says_why() -> None:
    fleet = FakeFleet({})
    outcome = await reconcile(reconciler([], fleet), spec_document())
    ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NoTargets")
    assert outcome.status["targets"]["summary"] == "0/0 updated"


@pytest.mark.looptime
async def test_unchanged_state_gives_an_unchanged_status() -> None:
    targets, fleet = two_servers()
    state = reconciling.PolicyMemory()
    first = await reconcile(reconciler(targets, fleet), spec_document(), state=state)
    later = reconciler(targets, fleet, now=NOW + datetime.timedelta(seconds=30))
    second = await reconcile(later, spec_document(), status=first.status, state=state)
    assert second.status == first.status, "a steady fleet must not rewrite its status every tick"
    assert second.events == ()


@pytest.mark.looptime
@pytest.mark.parametrize(
    "readings",
    [
        [
            {"queueDepth": 250},
            {"queueDepth": 320},
            {"queueDepth": 280},
        ],  # counting towards a switch
        [{"queueDepth": 20}, {"queueDepth": 35}, {"queueDepth": 5}],  # below, moving
        [{}, {}, {}],  # the signal missing
    ],
    ids=["counting", "moving", "missing"],
)
async def test_live_figures_leave_the_status_still(readings: list[dict[str, float]]) -> None:
    """The status is written when it changes: a reason quoting live figures or ages would
    make every pass of every policy a write (the scale benchmark saw one per reconcile)."""
    rule = {"profile": "bulk", "metric": "queueDepth", "above": 200, "for": "5m"}
    document = spec_document(load={"rules": [rule]})
    targets, fleet = two_servers()
    state = reconciling.PolicyMemory()
    statuses = []
    for number, metrics in enumerate(readings):
        at = NOW + datetime.timedelta(seconds=5 * number)
        subject = reconciler(targets, fleet, signals=FixedSignals(metrics), now=at)
        outcome = await reconcile(
            subject, document, status=statuses[-1] if statuses else None, state=state
        )
        statuses.append(outcome.status)
    assert statuses[1] == statuses[2]


@pytest.mark.looptime
async def test_failed_target_is_degraded_and_reported_once() -> None:
    targets, fleet = two_servers()
    fleet.servers[targets[1].http_url].unreachable = True
    subject = reconciler(targets, fleet)
    state = reconciling.PolicyMemory()
    first = await reconcile(subject, spec_document(), state=state)
    assert conditions(first.status)["Degraded"] == ("True", "TargetsFailed")
    assert first.status["targets"]["summary"] == "1/2 updated, 1 failed"
    warnings = [(e.reason, e.message) for e in first.events if e.type == "Warning"]
    assert warnings == [("TargetUnreachable", "pod triton-1: connection refused")]
    details = {d["name"]: d["state"] for d in first.status["targetDetails"]}
    assert details == {"triton-0": "Updated", "triton-1": "Unreachable"}
    second = await reconcile(subject, spec_document(), status=first.status, state=state)
    assert second.events == ()


@pytest.mark.looptime
async def test_each_policy_holds_the_servers_it_governs_until_it_is_forgotten() -> None:
    targets, fleet = two_servers()
    subject = reconciler(targets, fleet)
    await reconcile(subject, spec_document())
    assert fleet.held == {("ns", "fleet"): sorted(t.http_url for t in targets)}
    await subject.forget_policy("ns", "fleet")
    assert fleet.held == {}


def test_spec_model_is_what_reconcile_parses() -> None:
    assert specs.BatchPolicySpec.model_validate(spec_document()).default_profile == "bulk"


@pytest.mark.looptime
async def test_a_new_signal_source_for_a_changed_objective_closes_the_old_one() -> None:
    targets, fleet = two_servers()
    built: list[FixedSignals] = []

    def build(namespace: str, policy: specs.BatchPolicySpec, found: Any) -> FixedSignals:
        built.append(FixedSignals({}))
        return built[-1]

    subject = reconciler(targets, fleet)
    subject.signal_source = build
    state = reconciling.PolicyMemory()
    rules = {"rules": [{"profile": "bulk", "metric": "queueDepth", "above": 8}]}
    await reconcile(subject, spec_document(load=rules, slo={"p95LatencyMs": 50}), state=state)
    await reconcile(subject, spec_document(load=rules, slo={"p95LatencyMs": 50}), state=state)
    assert len(built) == 1
    await reconcile(subject, spec_document(load=rules, slo={"p95LatencyMs": 80}), state=state)
    assert [source.closed for source in built] == [True, False]
    await state.close_source()
    assert built[1].closed


@pytest.mark.looptime
async def test_the_engine_wakes_for_the_rollout_start_a_lead_before_the_boundary() -> None:
    targets, fleet = two_servers()
    spec = spec_document(schedule=market_hours(leadTime="90s"))
    before_open = ny(2026, 11, 24, 9, 20)
    outcome = await reconcile(reconciler(targets, fleet, now=before_open), spec)
    assert outcome.status["nextTransitionTime"] == "2026-11-24T14:30:00Z"
    assert outcome.status["plannedRolloutStart"] == "2026-11-24T14:28:30Z"
    assert outcome.status["leadTimeSeconds"] == 90
    assert outcome.wake_at == ny(2026, 11, 24, 9, 28, 30)


@pytest.mark.looptime
async def test_a_fleet_too_large_for_a_fixed_lead_is_reported_once() -> None:
    targets, fleet = two_servers()
    spec = spec_document(schedule=market_hours(leadTime="5s"))
    subject = reconciler(targets, fleet, now=ny(2026, 11, 24, 9, 20))
    state = reconciling.PolicyMemory()
    first = await reconcile(subject, spec, state=state)
    insufficient = conditions(first.status)["LeadTimeInsufficient"]
    assert insufficient == ("True", "FleetTooLargeForLead")
    warnings = [e.message for e in first.events if e.reason == "LeadTimeInsufficient"]
    assert warnings == [
        "rolling out takes 2 waves of 10.0s (assumed until one is measured), about 20s, longer "
        "than schedule.leadTime 5s: the last replicas switch up to 15s after a boundary; raise "
        "leadTime, set it to auto, or raise rollout.maxUnavailable"
    ]
    second = await reconcile(subject, spec, status=first.status, state=state)
    assert not any(e.reason == "LeadTimeInsufficient" for e in second.events)


@pytest.mark.looptime
async def test_a_measured_rollout_sets_the_auto_lead_and_survives_a_restart() -> None:
    targets, fleet = two_servers()
    fleet.apply_seconds = 3.0
    clock = Clock(ny(2026, 11, 24, 9, 20))
    subject = reconciler(targets, fleet)
    subject.clock = clock
    state = reconciling.PolicyMemory()
    first = await reconcile(subject, spec_document(schedule=market_hours()), state=state)
    assert first.status["measuredWaveSeconds"] == pytest.approx(3.0, abs=0.1)
    restarted = reconciling.PolicyMemory()
    again = await reconcile(
        subject, spec_document(schedule=market_hours()), status=first.status, state=restarted
    )
    assert again.status["leadTimeSeconds"] == pytest.approx(2 * 3.0 * 1.25 + 2, abs=0.3)


class PodsByNamespace:
    """Each namespace's policy finds its own Pods."""

    def __init__(self, found: dict[str, list[Replica]]) -> None:
        self.found = found

    async def replicas(
        self, namespace: str, target: specs.Target
    ) -> tuple[list[Replica], list[str]]:
        return list(self.found[namespace]), []


@pytest.mark.looptime
async def test_an_auto_lead_plans_for_the_slowest_rollout_that_ran_beside_its_own_on_its_node() -> (
    None
):
    # At a shared boundary reloads share the node: one policy's wave measured as the first to
    # finish says little of the wave it meets when the whole node switches together.
    fast, slow, elsewhere = (
        target("triton-0", node="node-a"),
        target("triton-1", node="node-a"),
        target("triton-2", node="node-b"),
    )
    fleet = FakeFleet(
        {
            fast.http_url: FakeServer(apply_seconds=2.0),
            slow.http_url: FakeServer(apply_seconds=9.0),
            elsewhere.http_url: FakeServer(apply_seconds=20.0),
        }
    )
    subject = reconciler([], fleet)
    subject.replica_source = PodsByNamespace({"a": [fast], "b": [slow], "c": [elsewhere]})
    subject.clock = Clock(ny(2026, 11, 24, 9, 0))
    spec = spec_document(schedule=market_hours())
    states = {namespace: reconciling.PolicyMemory() for namespace in "abc"}

    async def one(namespace: str) -> reconciling.Reconciled:
        return await subject.reconcile(
            namespace=namespace,
            name="fleet",
            spec=spec,
            status={},
            generation=1,
            state=states[namespace],
        )

    await asyncio.gather(*(one(namespace) for namespace in "abc"))
    assert states["a"].measured_wave_seconds == pytest.approx(2.0, abs=0.1)
    again = await one("a")
    assert again.status["measuredWaveSeconds"] == pytest.approx(9.0, abs=0.1), "not node-b's 20 s"
    assert again.status["leadTimeSeconds"] == pytest.approx(9.0 * 1.25 + 2, abs=0.3)
    # A rollout on the node that did not overlap any of its own teaches it nothing.
    await asyncio.sleep(60)
    fleet.servers[slow.http_url].apply_seconds = 30.0
    states["b"] = reconciling.PolicyMemory()
    await one("b")
    assert (await one("a")).status["measuredWaveSeconds"] == pytest.approx(9.0, abs=0.1)


class Clock:
    """The policy's clock, moving with the event loop's (fake) time."""

    def __init__(self, start: datetime.datetime) -> None:
        self.start = start

    def __call__(self) -> datetime.datetime:
        return self.start + datetime.timedelta(seconds=asyncio.get_running_loop().time())


@pytest.mark.looptime
async def test_a_drain_that_does_not_stop_requests_is_an_event_a_condition_and_a_metric() -> None:
    gated = target("triton-0", gated=True, gate="True")
    pinned = FakeServer(completed=[float(n) for n in range(0, 10_000, 3)])
    fleet = FakeFleet({gated.http_url: pinned})
    subject = reconciler([gated], fleet, FakeGates(fleet))
    spec = spec_document(rollout={"drainTimeoutSeconds": 3})
    outcome = await reconcile(subject, spec)
    assert outcome.status["activeProfile"] == "bulk", "the reload went ahead"
    drains = [e.message for e in outcome.events if e.reason == "DrainIneffective"]
    assert len(drains) == 1
    assert drains[0].startswith("pod triton-0 kept receiving requests after it left its Services")
    assert "reloaded after drainTimeoutSeconds" in drains[0]
    assert conditions(outcome.status)["DrainIneffective"] == ("True", "RequestsKeptArriving")
    assert gauge(subject, "batchpilot_drains_ineffective_total") == 1
    # No rollout the next time: the condition stays as the last drain left it.
    again = await reconcile(subject, spec, status=outcome.status)
    assert conditions(again.status)["DrainIneffective"] == ("True", "RequestsKeptArriving")


@pytest.mark.looptime
async def test_a_drain_whose_requests_stop_late_is_said_in_the_condition_but_is_no_warning() -> (
    None
):
    # kube-proxy on a busy node: requests for 1 s after the settle time, then none.
    gated = target("triton-0", gated=True, gate="True")
    late = FakeServer(completed=[0.0, 10.0, 13.0, 16.0, 19.0, 22.0, 25.0, 25.0])
    fleet = FakeFleet({gated.http_url: late})
    subject = reconciler([gated], fleet, FakeGates(fleet))
    outcome = await reconcile(subject, spec_document(rollout={"drainTimeoutSeconds": 10}))
    assert outcome.status["activeProfile"] == "bulk"
    assert not [e for e in outcome.events if e.reason == "DrainIneffective"]
    assert conditions(outcome.status)["DrainIneffective"] == ("False", "DrainsEffective")
    message = next(
        c["message"] for c in outcome.status["conditions"] if c["type"] == "DrainIneffective"
    )
    assert message.startswith("pod triton-0 received 15 requests after the settle time, then none")
    assert gauge(subject, "batchpilot_drains_ineffective_total") == 0


@pytest.mark.looptime
async def test_a_policy_with_only_an_objective_still_reads_its_signals() -> None:
    targets, fleet = two_servers()
    signals = FixedSignals({"p95LatencyMs": 12.0})
    subject = reconciler(targets, fleet, signals=signals)
    await reconcile(subject, spec_document(slo={"p95LatencyMs": 50}))
    sample = subject.metrics.registry.get_sample_value
    assert (
        sample(
            "batchpilot_signal",
            {"policy_namespace": "ns", "policy": "fleet", "metric": "p95LatencyMs"},
        )
        == 12.0
    )


async def test_a_deleted_policy_opens_every_gate_it_left_closed_and_only_those() -> None:
    gates = FakeGates()
    targets = [
        target("triton-0", gated=True, gate="False"),  # a rollout stopped half way
        target("triton-1", gated=True, gate="True"),
        target("triton-2", gated=True),  # never switched: no condition yet
        target("triton-3"),  # no gate at all
    ]
    subject = reconciler(targets, FakeFleet({}), gates)
    opened = await subject.release_pods("ns", spec_document())
    assert opened == ["triton-0", "triton-2"]
    assert gates.changes == [
        ("triton-0", True, "PolicyDeleted"),
        ("triton-2", True, "PolicyDeleted"),
    ]


async def test_a_deleted_policy_whose_target_says_nothing_opens_nothing() -> None:
    gates = FakeGates()
    subject = reconciler([target("triton-0", gated=True, gate="False")], FakeFleet({}), gates)
    assert await subject.release_pods("ns", {"target": {"port": "http"}}) == []
    assert gates.changes == []


class FakeNotInjected:
    """Pods that opted into the webhook and were created without it, by name and labels."""

    def __init__(self, **pods: dict[str, str]) -> None:
        self.pods = pods
        self.asked: list[tuple[str, dict[str, Any]]] = []

    async def not_injected(self, namespace: str, selector: Any) -> list[str]:
        wanted = selector.model_dump(by_alias=True)
        self.asked.append((namespace, wanted))
        return sorted(
            name for name, labels in self.pods.items() if governing.selects(wanted, labels)
        )


async def test_pods_created_without_the_webhook_s_injection_are_named_in_the_status_once() -> None:
    """Opted in by label, created while the webhook did not answer: batchpilot cannot switch
    them; the status and one event say so, and which, until they are gone."""
    targets, fleet = two_servers()
    subject = reconciler(targets, fleet)
    late = FakeNotInjected(**{"triton-late": {"app": "triton"}, "other-app": {"app": "other"}})
    subject.not_injected = late
    spec = spec_document(target={"selector": {"matchLabels": {"app": "triton"}}, "port": "http"})
    state = reconciling.PolicyMemory()
    status: dict[str, Any] = {}
    events: list[str] = []
    for _ in range(3):
        outcome = await reconcile(subject, spec, status=status, state=state)
        status, events = outcome.status, events + [event.reason for event in outcome.events]
    assert late.asked[0] == ("ns", {"matchLabels": {"app": "triton"}, "matchExpressions": []})
    assert conditions(status)["PodsNotInjected"] == ("True", "CreatedWithoutInjection")
    message = next(c["message"] for c in status["conditions"] if c["type"] == "PodsNotInjected")
    assert message.startswith("triton-late: opted in (batchpilot.dev/inject=true) but created")
    assert "other-app" not in message, "only the Pods its selector matches"
    assert message.endswith("Delete them: their replacements are injected")
    assert events.count("PodsNotInjected") == 1  # a standing problem, said once
    assert conditions(status)["Ready"] == ("True", "RolledOut"), "the Pods it governs are fine"

    late.pods.clear()  # deleted, and replaced by an injected Pod
    outcome = await reconcile(subject, spec, status=status, state=state)
    assert conditions(outcome.status)["PodsNotInjected"] == ("False", "AllInjected")


@pytest.mark.looptime
async def test_two_policies_selecting_one_pod_do_not_flap_it_the_older_governs() -> None:
    labelled = [
        dataclasses.replace(replica, labels=(("app", "triton"),))
        for replica in (target("triton-0"), target("triton-1"))
    ]
    fleet = FakeFleet({replica.http_url: FakeServer() for replica in labelled})
    selector = {"matchLabels": {"app": "triton"}}
    policies = [
        # Listed newest first: seniority, not order, decides.
        governing.Governor("new-desk", "2026-06-01T00:00:00Z", selector),
        governing.Governor("old-desk", "2026-01-01T00:00:00Z", selector),
    ]
    subject = reconciler(labelled, fleet)
    subject.governors = lambda namespace: policies
    wants = {"old-desk": "interactive", "new-desk": "bulk"}
    states = {name: reconciling.PolicyMemory() for name in wants}
    status: dict[str, dict[str, Any]] = {name: {} for name in wants}
    events: dict[str, list[str]] = {name: [] for name in wants}

    for _ in range(3):
        for name, profile in wants.items():
            outcome = await subject.reconcile(
                namespace="ns",
                name=name,
                spec=spec_document(defaultProfile=profile),
                status=status[name],
                generation=1,
                state=states[name],
            )
            status[name] = outcome.status
            events[name] += [event.reason for event in outcome.events]

    assert [server.profile for server in fleet.servers.values()] == ["interactive"] * 2
    assert [call for call, _ in fleet.calls] == ["apply", "apply"]  # once each, never back
    assert conditions(status["old-desk"])["PodsContested"] == ("False", "NoOverlap")
    assert conditions(status["new-desk"])["PodsContested"] == (
        "True",
        "GovernedByAnotherPolicy",
    )
    message = next(
        c["message"] for c in status["new-desk"]["conditions"] if c["type"] == "PodsContested"
    )
    assert "pod triton-0 is governed by policy 'old-desk'" in message
    assert events["new-desk"].count("PodsContested") == 1  # a standing problem, said once
    assert status["new-desk"]["targets"]["total"] == 0
    ready = next(c for c in status["new-desk"]["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "every Pod it selects is governed by an older policy"


@pytest.mark.looptime
async def test_a_deleted_policy_opens_no_gate_of_a_pod_an_older_policy_governs() -> None:
    closed = dataclasses.replace(
        target("triton-0", gated=True, gate="False"), labels=(("app", "triton"),)
    )
    gates = FakeGates()
    subject = reconciler([closed], FakeFleet({closed.http_url: FakeServer()}), gates)
    selector = {"matchLabels": {"app": "triton"}}
    subject.governors = lambda namespace: [
        governing.Governor("old-desk", "2026-01-01T00:00:00Z", selector)
    ]
    # The older policy may be half way through switching it: its gate is that policy's.
    assert await subject.release_pods("ns", spec_document(), name="new-desk") == []
    assert await subject.release_pods("ns", spec_document(), name="old-desk") == ["triton-0"]
    assert gates.changes == [("triton-0", True, "PolicyDeleted")]


# The policy's series: named by namespace and name, and gone with what they were about ---------


def series_of(subject: reconciling.Reconciler, namespace: str, name: str) -> dict[str, float]:
    """Every sample the policy exports, as `name{other labels}` -> value."""
    found = {}
    for family in subject.metrics.registry.collect():
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("policy_namespace", None) != namespace:
                continue
            if labels.pop("policy", None) != name:
                continue
            others = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
            found[f"{sample.name}{{{others}}}"] = sample.value
    return found


@pytest.mark.looptime
async def test_like_named_policies_of_two_namespaces_keep_separate_series() -> None:
    """`prod` of team-b reports a healthy p95; were it written over team-a's `prod`, team-a's
    breach would vanish from the page and its SLO alert with it."""
    targets, fleet = two_servers()
    readings = {
        "team-a": FixedSignals({"p95LatencyMs": 400.0}),
        "team-b": FixedSignals({"p95LatencyMs": 20.0}),
    }
    subject = reconciling.Reconciler(
        replicas=FakePods(targets),
        gates=FakeGates(),
        fleet=fleet,
        signal_source=lambda namespace, policy, found: readings[namespace],
        metrics=telemetry.controller_metrics(),
        clock=lambda: NOW,
        settle_seconds=0,
    )
    spec = spec_document(slo={"p95LatencyMs": 50, "profiles": ["bulk"]})
    for namespace in readings:
        await subject.reconcile(
            namespace=namespace,
            name="prod",
            spec=spec,
            status={},
            generation=1,
            state=reconciling.PolicyMemory(),
        )
    team_a, team_b = series_of(subject, "team-a", "prod"), series_of(subject, "team-b", "prod")
    assert team_a["batchpilot_signal{metric=p95LatencyMs}"] == 400.0
    assert team_b["batchpilot_signal{metric=p95LatencyMs}"] == 20.0
    assert team_a["batchpilot_slo_p95_latency_seconds{}"] == 0.05
    assert team_a["batchpilot_active_profile{profile=bulk}"] == 1
    assert team_b["batchpilot_active_profile{profile=bulk}"] == 1


@pytest.mark.looptime
async def test_a_deleted_policy_takes_its_series_with_it_and_its_namesake_keeps_its_own() -> None:
    targets, fleet = two_servers()
    subject = reconciler(targets, fleet, signals=FixedSignals({"p95LatencyMs": 30.0}))
    spec = spec_document(slo={"p95LatencyMs": 50, "profiles": ["bulk"]})
    for namespace in ("team-a", "team-b"):
        await subject.reconcile(
            namespace=namespace,
            name="prod",
            spec=spec,
            status={},
            generation=1,
            state=reconciling.PolicyMemory(),
        )
    kept = series_of(subject, "team-b", "prod")
    assert series_of(subject, "team-a", "prod")["batchpilot_signal{metric=p95LatencyMs}"] == 30
    await subject.forget_policy("team-a", "prod")
    assert series_of(subject, "team-a", "prod") == {}
    assert series_of(subject, "team-b", "prod") == kept
    assert subject.metrics.exported.keys() == {telemetry.PolicyLabels("team-b", "prod")}


@pytest.mark.looptime
async def test_series_of_a_profile_dropped_from_the_spec_or_a_signal_no_longer_read_leave() -> None:
    targets, fleet = two_servers()
    signals = FixedSignals({"queueDepth": 3.0, "p95LatencyMs": 12.0})
    subject = reconciler(targets, fleet, signals=signals)
    profiles = spec_document()["profiles"]
    with_overnight = spec_document(
        profiles={**profiles, "overnight": {"maxQueueDelayMicroseconds": 90000}},
        load={"rules": [{"profile": "interactive", "metric": "queueDepth", "above": 100}]},
    )
    state = reconciling.PolicyMemory()
    await reconcile(subject, with_overnight, state=state)
    before = series_of(subject, "ns", "fleet")
    assert before["batchpilot_active_profile{profile=overnight}"] == 0
    assert before["batchpilot_signal{metric=queueDepth}"] == 3.0

    # The profile is edited away, and with the load rules gone no signal is read.
    await reconcile(subject, spec_document(), state=state)
    after = series_of(subject, "ns", "fleet")
    assert [series for series in after if "overnight" in series] == []
    assert [series for series in after if series.startswith("batchpilot_signal{")] == []
    assert after["batchpilot_active_profile{profile=bulk}"] == 1
    assert after["batchpilot_profile_switches_total{profile=interactive}"] == 0


@pytest.mark.looptime
async def test_a_triton_container_restarted_between_passes_has_its_gate_closed_first() -> None:
    run_1 = ServingContainer(name="triton", run="containerd://1")
    pod = dataclasses.replace(target("triton-0", gated=True, gate="True"), serving=run_1)
    fleet = FakeFleet({pod.http_url: FakeServer(profile="bulk")})
    gates = FakeGates()
    subject = reconciler([pod], fleet, gates)
    state = reconciling.PolicyMemory()
    await reconcile(subject, spec_document(), state=state)
    assert (gates.changes, state.vouched) == ([], {"triton-0": "containerd://1"})
    # The container restarted: Triton serves its repository's configuration again.
    restarted = dataclasses.replace(
        pod, serving=ServingContainer(name="triton", run="containerd://2")
    )
    subject.replica_source = FakePods([restarted])
    fleet.servers[pod.http_url].profile = None
    outcome = await reconcile(subject, spec_document(), state=state)
    assert gates.changes == [
        ("triton-0", False, "ContainerRestarted"),
        ("triton-0", False, "Switching"),
        ("triton-0", True, "ConfigApplied"),
    ]
    assert [event.reason for event in outcome.events].count("ContainerRestarted") == 1
    assert state.vouched == {"triton-0": "containerd://2"}
