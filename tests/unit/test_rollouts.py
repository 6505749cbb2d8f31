"""Rolling a profile out: waves, hitless switching through the gate, failures and the halt."""

from __future__ import annotations

import pytest
from operator_fakes import FakeFleet, FakeGates, FakeServer, target

from batchpilot.applying import actuators, rollouts
from batchpilot.policy import rendering, specs

PROFILE = specs.Profile.model_validate({"maxQueueDelayMicroseconds": 2000})


def plan(targets: list[object], **rollout: object) -> rollouts.Plan:
    return rollouts.Plan(
        namespace="ns",
        profile="interactive",
        settings=rendering.render(PROFILE),
        models={t.http_url: ["gpu_sim"] for t in targets},  # type: ignore[attr-defined]
        rollout=specs.Rollout.model_validate(rollout),
        settle_seconds=0.5,
    )


def fleet_for(targets: list[object], **server: object) -> FakeFleet:
    return FakeFleet({t.http_url: FakeServer(**server) for t in targets})  # type: ignore[attr-defined,arg-type]


@pytest.mark.looptime
async def test_replicas_already_running_the_profile_are_left_alone() -> None:
    targets = [target("triton-0"), target("triton-1")]
    fleet = fleet_for(targets, profile="interactive")
    result = await rollouts.roll_out(targets, plan(targets), fleet, FakeGates())
    assert [o.state for o in result.outcomes] == ["Updated", "Updated"]
    assert fleet.calls == []


@pytest.mark.looptime
async def test_waves_never_exceed_max_unavailable() -> None:
    targets = [target(f"triton-{i}") for i in range(5)]
    fleet = fleet_for(targets)
    fleet.apply_seconds = 1.0
    result = await rollouts.roll_out(targets, plan(targets, maxUnavailable=2), fleet, FakeGates())
    assert result.count("Updated") == 5
    assert fleet.most_in_flight == 2
    assert sum(o.reloads for o in result.outcomes) == 5


@pytest.mark.looptime
async def test_gated_replica_leaves_service_drains_applies_and_returns() -> None:
    gated = target("triton-0", gated=True, gate="True")
    fleet = fleet_for([gated], pending=[3, 1, 0])
    gates = FakeGates(fleet)
    result = await rollouts.roll_out([gated], plan([gated]), fleet, gates)
    assert result.outcomes[0].state == "Updated"
    assert [call for call, _ in fleet.calls] == [
        "gate-close",
        "pending",
        "pending",
        "pending",
        "apply",
        "gate-open",
    ]
    assert gates.changes == [("triton-0", False, "Switching"), ("triton-0", True, "ConfigApplied")]
    assert result.seconds >= 0.5 + 2 * rollouts.DRAIN_POLL_SECONDS


@pytest.mark.looptime
async def test_drain_is_bounded_by_its_timeout() -> None:
    gated = target("triton-0", gated=True, gate="True")
    fleet = fleet_for([gated], pending=[5.0] * 10_000)
    result = await rollouts.roll_out(
        [gated], plan([gated], drainTimeoutSeconds=3), fleet, FakeGates(fleet)
    )
    assert result.outcomes[0].state == "Updated"
    assert 3 <= result.seconds < 3.5


@pytest.mark.looptime
async def test_up_to_date_replica_with_a_closed_gate_gets_it_opened() -> None:
    # What an operator killed between "apply" and "gate True" leaves behind.
    stuck = target("triton-0", gated=True, gate="False")
    fleet = fleet_for([stuck], profile="interactive")
    gates = FakeGates()
    result = await rollouts.roll_out([stuck], plan([stuck]), fleet, gates)
    assert result.outcomes[0].state == "Updated"
    assert gates.changes == [("triton-0", True, "ConfigApplied")]


@pytest.mark.looptime
async def test_failed_replica_is_rolled_back_reopened_and_the_rollout_halts() -> None:
    targets = [target(f"triton-{i}", gated=True, gate="True") for i in range(4)]
    fleet = fleet_for(targets)
    fleet.servers[targets[0].http_url].fail_with = actuators.ApplyFailed(
        targets[0].http_url, "load rejected", rolled_back=True
    )
    gates = FakeGates()
    result = await rollouts.roll_out(targets, plan(targets, maxUnavailable=1), fleet, gates)
    assert [o.state for o in result.outcomes] == ["Failed", "Pending", "Pending", "Pending"]
    assert result.halted
    assert result.outcomes[0].rolled_back
    assert "previous configuration restored" in result.outcomes[0].message
    assert "rollout halted after 1 failures" in result.outcomes[1].message
    assert ("triton-0", True, "RolledBack") in gates.changes
    assert {pod for pod, _, _ in gates.changes} == {"triton-0"}


@pytest.mark.looptime
async def test_failures_below_max_unavailable_do_not_stop_the_rollout() -> None:
    targets = [target(f"triton-{i}") for i in range(4)]
    fleet = fleet_for(targets)
    fleet.servers[targets[1].http_url].unreachable = True
    result = await rollouts.roll_out(targets, plan(targets, maxUnavailable=2), fleet, FakeGates())
    assert [o.state for o in result.outcomes] == ["Updated", "Unreachable", "Updated", "Updated"]
    assert not result.halted


@pytest.mark.looptime
async def test_refused_profile_is_a_failure_that_changes_nothing() -> None:
    targets = [target("triton-0")]
    fleet = fleet_for(targets, refuse="maxBatchSize 256 is above model 'gpu_sim''s own 128")
    result = await rollouts.roll_out(targets, plan(targets), fleet, FakeGates())
    assert result.outcomes[0].state == "Failed"
    assert "maxBatchSize 256" in result.outcomes[0].message
    assert ("apply", targets[0].http_url) not in fleet.calls
