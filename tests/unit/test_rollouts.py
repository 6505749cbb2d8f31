"""Rolling a profile out: the survey, waves, hitless switching through the gate, failures and
the halt, and the one mapping from what went wrong to the reason it is reported by."""

from __future__ import annotations

import dataclasses

import pytest
from operator_fakes import FakeFleet, FakeGates, FakeServer, target

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, backoffs, overrides, rollouts
from batchpilot.applying.replicas import Replica, ServingContainer
from batchpilot.policy import rendering
from batchpilot_triton import servers

PROFILE = specs.Profile.model_validate({"maxQueueDelayMicroseconds": 2000})


def plan(**rollout: object) -> rollouts.Plan:
    return rollouts.Plan(
        namespace="ns",
        profile="interactive",
        settings=rendering.render(PROFILE),
        rollout=specs.Rollout.model_validate(rollout),
        settle_seconds=0.5,
    )


def fleet_for(replicas: list[Replica], **server: object) -> FakeFleet:
    return FakeFleet({r.http_url: FakeServer(**server) for r in replicas})  # type: ignore[arg-type]


async def roll_out(
    replicas: list[Replica], fleet: FakeFleet, gates: FakeGates | None = None, **rollout: object
) -> rollouts.Result:
    found = await rollouts.survey(replicas, ["gpu_sim"], fleet)
    return await rollouts.roll_out(replicas, found, plan(**rollout), fleet, gates or FakeGates())


async def drain_of_one_gated_pod(drain_timeout_seconds: int, **server: object) -> rollouts.Drain:
    """Switch one gated Pod whose server reports `server` (queue and completions per look);
    the drain its switch ran."""
    gated = target("triton-0", gated=True, gate="True")
    fleet = fleet_for([gated], **server)
    result = await roll_out(
        [gated], fleet, FakeGates(fleet), drainTimeoutSeconds=drain_timeout_seconds
    )
    drain = result.outcomes[0].drain
    assert drain is not None
    return drain


@pytest.mark.looptime
async def test_replicas_already_running_the_profile_are_left_alone() -> None:
    replicas = [target("triton-0"), target("triton-1")]
    fleet = fleet_for(replicas, profile="interactive")
    result = await roll_out(replicas, fleet)
    assert [o.state for o in result.outcomes] == ["Updated", "Updated"]
    assert fleet.calls == []


@pytest.mark.looptime
async def test_waves_never_exceed_max_unavailable() -> None:
    replicas = [target(f"triton-{i}") for i in range(5)]
    fleet = fleet_for(replicas)
    fleet.apply_seconds = 1.0
    result = await roll_out(replicas, fleet, maxUnavailable=2)
    assert result.count("Updated") == 5
    assert fleet.most_in_flight == 2
    assert result.reloads == 5


@pytest.mark.looptime
async def test_gated_replica_leaves_service_drains_applies_and_returns() -> None:
    gated = target("triton-0", gated=True, gate="True")
    fleet = fleet_for([gated], pending=[3, 3, 1, 0])  # closed, settled, then two polls
    gates = FakeGates(fleet)
    result = await roll_out([gated], fleet, gates)
    assert result.outcomes[0].state == "Updated"
    assert [call for call, _ in fleet.calls] == [
        "gate-close",
        "pending",
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
    result = await roll_out([gated], fleet, FakeGates(fleet), drainTimeoutSeconds=3)
    assert result.outcomes[0].state == "Updated"
    assert 3 <= result.seconds < 3.5


@pytest.mark.looptime
async def test_up_to_date_replica_with_a_closed_gate_gets_it_opened() -> None:
    # What an operator killed between "apply" and "gate True" leaves behind.
    stuck = target("triton-0", gated=True, gate="False")
    fleet = fleet_for([stuck], profile="interactive")
    gates = FakeGates()
    result = await roll_out([stuck], fleet, gates)
    assert result.outcomes[0].state == "Updated"
    assert gates.changes == [("triton-0", True, "ConfigApplied")]


def serving(name: str, run: str, *, gate: str = "True") -> Replica:
    return dataclasses.replace(
        target(name, gated=True, gate=gate),
        serving=ServingContainer(name="triton", run=run, stopped="" if run else "Error"),
    )


def test_an_open_gate_whose_container_is_another_run_than_vouched_for_is_marked() -> None:
    marked = rollouts.mark_restarted(
        [
            serving("triton-0", "id-2"),
            serving("triton-1", "id-1"),
            serving("triton-2", ""),
            serving("triton-3", "id-9", gate="False"),
            serving("triton-4", "id-7"),
        ],
        {"triton-0": "id-1", "triton-1": "id-1", "triton-2": "id-1", "triton-3": "id-1"},
    )
    assert [replica.restarted for replica in marked] == [
        "container triton restarted",
        None,
        "container triton is not running (Error)",
        None,  # already out of its Services: the rollout switches it back anyway
        None,  # never vouched for (an operator that just started): the drift check covers it
    ]


def test_a_pass_vouches_for_the_runs_it_left_open_on_the_profile_and_keeps_the_rest() -> None:
    result = rollouts.Result(
        (
            rollouts.Outcome(serving("triton-0", "id-2"), "Updated", "bulk"),
            rollouts.Outcome(serving("triton-1", "id-5"), "Unreachable", None),
            rollouts.Outcome(serving("triton-2", "id-3"), "Updated", "bulk", left_out=True),
        )
    )
    vouched = {"triton-0": "id-1", "triton-1": "id-1", "triton-2": "id-1", "gone": "id-1"}
    assert rollouts.vouched_after(result, vouched) == {
        "triton-0": "id-2",
        "triton-1": "id-1",
        "triton-2": "id-1",
    }


@pytest.mark.looptime
async def test_a_restarted_container_s_gate_closes_first_and_opens_once_the_profile_is_back() -> (
    None
):
    # Triton came back with its repository's configuration: the kubelet would make the Pod
    # Ready on it as soon as Triton answers its probe.
    restarted = dataclasses.replace(
        serving("triton-0", "id-2"), restarted="container triton restarted"
    )
    fleet = fleet_for([restarted])
    gates = FakeGates(fleet)
    result = await roll_out([restarted], fleet, gates)
    assert result.outcomes[0].state == "Updated"
    assert gates.changes == [
        ("triton-0", False, "ContainerRestarted"),
        ("triton-0", False, "Switching"),
        ("triton-0", True, "ConfigApplied"),
    ]
    assert result.restarts == (
        "pod triton-0: container triton restarted since it last served interactive; out of its "
        "Services until it does again",
    )


@pytest.mark.looptime
async def test_a_restarted_container_that_does_not_answer_yet_stays_out_of_its_services() -> None:
    restarted = dataclasses.replace(
        serving("triton-0", ""), restarted="container triton is not running (Error)"
    )
    other = target("triton-1", gated=True, gate="True")
    fleet = FakeFleet(
        {restarted.http_url: FakeServer(unreachable=True), other.http_url: FakeServer()}
    )
    gates = FakeGates()
    result = await roll_out([restarted, other], fleet, gates, maxUnavailable=1)
    assert [o.state for o in result.outcomes] == ["Unreachable", "Pending"]
    # Closed and left closed; the dead Pod fills the budget, so the other one keeps serving.
    assert gates.changes == [("triton-0", False, "ContainerRestarted")]


@pytest.mark.looptime
async def test_failed_replica_is_rolled_back_reopened_and_the_rollout_halts() -> None:
    replicas = [target(f"triton-{i}", gated=True, gate="True") for i in range(4)]
    fleet = fleet_for(replicas)
    fleet.servers[replicas[0].http_url].fail_with = actuators.ApplyFailed(
        replicas[0].http_url, "load rejected", rolled_back=True
    )
    gates = FakeGates()
    result = await roll_out(replicas, fleet, gates, maxUnavailable=1)
    assert [o.state for o in result.outcomes] == ["Failed", "Pending", "Pending", "Pending"]
    assert result.halted
    assert result.outcomes[0].error == "rejected"
    assert "previous configuration restored" in result.outcomes[0].message
    assert "rollout halted after 1 failures" in result.outcomes[1].message
    assert ("triton-0", True, "RolledBack") in gates.changes
    assert {pod for pod, _, _ in gates.changes} == {"triton-0"}


@pytest.mark.looptime
async def test_failures_below_max_unavailable_do_not_stop_the_rollout() -> None:
    replicas = [target(f"triton-{i}") for i in range(4)]
    fleet = fleet_for(replicas)
    fleet.servers[replicas[1].http_url].fail_with = servers.LoadRejected(replicas[1].http_url, "no")
    result = await roll_out(replicas, fleet, maxUnavailable=2)
    assert [o.state for o in result.outcomes] == ["Updated", "Failed", "Updated", "Updated"]
    assert not result.halted


@pytest.mark.looptime
async def test_a_replica_that_does_not_answer_is_skipped_and_holds_up_no_other() -> None:
    replicas = [target(f"triton-{i}") for i in range(3)]
    fleet = fleet_for(replicas)
    fleet.servers[replicas[0].http_url].unreachable = True
    result = await roll_out(replicas, fleet, maxUnavailable=1)
    assert [o.state for o in result.outcomes] == ["Unreachable", "Updated", "Updated"]
    assert result.outcomes[0].error == "unreachable"
    assert not result.halted


@pytest.mark.looptime
async def test_no_gated_replica_leaves_its_services_while_a_dead_one_fills_the_budget() -> None:
    replicas = [target(f"triton-{i}", gated=True, gate="True") for i in range(3)]
    fleet = fleet_for(replicas)
    fleet.servers[replicas[0].http_url].unreachable = True
    gates = FakeGates()
    result = await roll_out(replicas, fleet, gates, maxUnavailable=1)
    assert [o.state for o in result.outcomes] == ["Unreachable", "Pending", "Pending"]
    assert result.outcomes[1].message == "held: triton-0 out of service, rollout.maxUnavailable 1"
    assert gates.changes == []
    assert not result.halted


@pytest.mark.looptime
async def test_the_next_pod_leaves_its_services_only_once_the_one_let_back_in_is_ready() -> None:
    # cold3: triton-0's gate opened and triton-1's closed at once, before the kubelet had made
    # triton-0 Ready: for a moment the Service had no Ready endpoint, and 2 requests were refused.
    replicas = [target(f"triton-{i}", gated=True, gate="True") for i in range(3)]
    fleet = fleet_for(replicas)
    gates = FakeGates(fleet)
    result = await roll_out(replicas, fleet, gates, maxUnavailable=1)
    assert result.count("Updated") == 3
    steps = [call for call in fleet.calls if call[0] in ("gate-open", "gate-close", "wait-ready")]
    assert steps == [
        ("gate-close", "triton-0"),
        ("gate-open", "triton-0"),
        ("wait-ready", "triton-0"),
        ("gate-close", "triton-1"),
        ("gate-open", "triton-1"),
        ("wait-ready", "triton-1"),
        ("gate-close", "triton-2"),
        ("gate-open", "triton-2"),
    ]


@pytest.mark.looptime
async def test_a_pod_let_back_in_that_never_turns_ready_holds_the_rest_in_service() -> None:
    # triton-0 is out of its Services (a rollback that failed, say), so it goes first.
    replicas = [
        target("triton-0", gated=True, gate="False"),
        target("triton-1", gated=True, gate="True"),
    ]
    fleet = fleet_for(replicas)
    gates = FakeGates(fleet)
    gates.never_ready = {"triton-0"}
    result = await roll_out(replicas, fleet, gates, maxUnavailable=1)
    assert [o.state for o in result.outcomes] == ["Updated", "Pending"]
    assert result.outcomes[1].message == "held: triton-0 out of service, rollout.maxUnavailable 1"
    assert gates.changes == [("triton-0", False, "Switching"), ("triton-0", True, "ConfigApplied")]
    assert gates.waits == [["triton-0"]]
    assert result.seconds >= rollouts.READY_TIMEOUT_SECONDS


@pytest.mark.looptime
async def test_pods_already_out_of_service_and_ungated_replicas_switch_without_a_wait() -> None:
    closed = [target(f"triton-{i}", gated=True, gate="False") for i in range(2)]
    plain = [target("triton-2"), target("triton-3")]
    fleet = fleet_for([*closed, *plain])
    gates = FakeGates(fleet)
    result = await roll_out([*closed, *plain], fleet, gates, maxUnavailable=1)
    assert result.count("Updated") == 4
    assert gates.waits == []  # none of its waves took a serving Pod out of its Services


@pytest.mark.looptime
async def test_a_dead_replica_narrows_the_waves_of_gated_ones() -> None:
    replicas = [target(f"triton-{i}", gated=True, gate="True") for i in range(4)]
    fleet = fleet_for(replicas)
    fleet.apply_seconds = 1.0
    fleet.servers[replicas[0].http_url].unreachable = True
    result = await roll_out(replicas, fleet, maxUnavailable=2)
    assert [o.state for o in result.outcomes] == ["Unreachable", "Updated", "Updated", "Updated"]
    assert fleet.most_in_flight == 1


@pytest.mark.looptime
async def test_replicas_already_out_of_their_services_switch_first_and_cost_no_budget() -> None:
    replicas = [
        target("triton-0", gated=True, gate="True"),
        target("triton-1", gated=True, gate="True"),
        target("triton-2", gated=True, gate="False"),  # left out by an interrupted rollout
    ]
    fleet = fleet_for(replicas)
    result = await roll_out(replicas, fleet, maxUnavailable=1)
    assert result.count("Updated") == 3
    applied = [url for call, url in fleet.calls if call == "apply"]
    assert applied == [replicas[2].http_url, replicas[0].http_url, replicas[1].http_url]


@pytest.mark.looptime
async def test_a_replica_backing_off_is_reported_but_its_failure_is_not_counted_again() -> None:
    replicas = [target("triton-0")]
    fleet = fleet_for(replicas)
    fleet.servers[replicas[0].http_url].unreachable = True
    fleet.backing_off = True
    result = await roll_out(replicas, fleet)
    assert result.outcomes[0].state == "Unreachable"
    assert result.outcomes[0].message == "connection refused"
    assert result.outcomes[0].error is None


@pytest.mark.looptime
async def test_refused_profile_is_a_failure_that_changes_nothing() -> None:
    replicas = [target("triton-0")]
    fleet = fleet_for(replicas, refuse="maxBatchSize 256 is above model 'gpu_sim''s own 128")
    result = await roll_out(replicas, fleet)
    assert result.outcomes[0].state == "Failed"
    assert result.outcomes[0].error == "refused"
    assert "maxBatchSize 256" in result.outcomes[0].message
    assert ("apply", replicas[0].http_url) not in fleet.calls


async def test_the_survey_names_every_model_a_replica_lacks() -> None:
    replicas = [target("triton-0"), target("triton-1")]
    fleet = fleet_for(replicas)
    fleet.servers[replicas[1].http_url].models = ["torch_mlp"]
    found = await rollouts.survey(replicas, ["gpu_sim"], fleet)
    assert found.missing == (
        "spec.target.models: 'gpu_sim' not loaded on pod triton-1 (it has: torch_mlp)",
    )


async def test_the_survey_governs_every_loaded_model_when_the_policy_names_none() -> None:
    replicas = [target("triton-0")]
    fleet = fleet_for(replicas, models=["a", "b"])
    found = await rollouts.survey(replicas, [], fleet)
    assert found.models == {replicas[0].http_url: ["a", "b"]}
    assert found.missing == ()


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (overrides.ProfileRefused("too big"), "refused"),
        (actuators.ApplyFailed("u", "bad", rolled_back=True), "rejected"),
        (actuators.ApplyFailed("u", "bad", rolled_back=False), "rollback_failed"),
        (servers.Unreachable("u", "refused"), "unreachable"),
        (backoffs.BackingOff("u", "refused", retry_in=2), "unreachable"),
        (servers.ExplicitModeRequired("u", "no"), "explicit_mode_required"),
        (servers.ModelUnavailable("u", "gone"), "model_unavailable"),
        (servers.LoadRejected("u", "bad"), "failed"),
    ],
)
def test_every_failure_maps_to_one_reason(failure: Exception, reason: str) -> None:
    assert rollouts.error_of(failure) == reason


@pytest.mark.looptime
async def test_a_pod_that_keeps_receiving_requests_is_drained_until_the_timeout_then_switched() -> (
    None
):
    # Pinned clients: the queue is empty at every look, but requests keep completing.
    gated = target("triton-0", gated=True, gate="True")
    fleet = fleet_for([gated], completed=[float(n) for n in range(0, 10_000, 5)])
    result = await roll_out([gated], fleet, FakeGates(fleet), drainTimeoutSeconds=4)
    outcome = result.outcomes[0]
    assert outcome.state == "Updated", "the reload goes ahead after the drain timeout"
    assert outcome.drain is not None
    assert outcome.drain.ineffective
    assert outcome.drain.timed_out
    assert 4 <= outcome.drain.seconds < 4.5
    assert outcome.drain.arrived >= 5 * int((4 - 0.5) / rollouts.DRAIN_POLL_SECONDS) - 5


@pytest.mark.looptime
async def test_a_pod_whose_requests_stop_is_drained_without_waiting_for_the_timeout() -> None:
    drain = await drain_of_one_gated_pod(30, pending=[2, 0, 0], completed=[100, 102, 102])
    assert not drain.ineffective
    assert not drain.timed_out
    assert drain.seconds < 1.5


@pytest.mark.looptime
async def test_a_sparse_client_pinned_to_the_pod_is_drained_until_the_timeout() -> None:
    # One keep-alive connection, a request every third poll: gaps longer than a poll between
    # requests that keep coming. The quiet window scales with the gaps it saw.
    polls = [3.0 + n // 3 for n in range(10_000)]
    drain = await drain_of_one_gated_pod(6, completed=[0.0, *polls])
    assert drain.timed_out, f"ended after a gap: {drain}"
    assert drain.ineffective
    assert not drain.late


@pytest.mark.looptime
async def test_requests_that_stop_after_the_settle_time_are_late_not_ineffective() -> None:
    # A proxy that learned of the Pod's leaving 2 s late: requests for 2 s, then none.
    arriving = [20.0 + 2 * n for n in range(11)]
    drain = await drain_of_one_gated_pod(15, completed=[0.0, *arriving, arriving[-1]])
    assert drain.arrived == 20
    assert not drain.timed_out
    assert drain.late
    assert not drain.ineffective
    assert drain.seconds < 0.5 + 2.0 + 1.0, "it waited for the requests, then not much longer"


@pytest.mark.looptime
async def test_a_pod_with_few_requests_is_drained_within_a_few_of_their_gaps() -> None:
    # Two requests during the 0.5-s settle time, none after: a gap of 0.25 s, so a second of
    # quiet, not the drain timeout.
    drain = await drain_of_one_gated_pod(15, completed=[0.0, 2.0, 2.0])
    assert not drain.timed_out
    assert drain.seconds == pytest.approx(0.5 + rollouts.QUIET_GAPS * 0.25, abs=0.2)


@pytest.mark.looptime
async def test_requests_that_follow_the_service_end_the_drain_after_one_quiet_poll() -> None:
    # Many requests during the settle time, none after: the rate they set is no reason to wait.
    drain = await drain_of_one_gated_pod(15, completed=[0.0, 150.0, 150.0])
    assert drain.arrived == 0
    assert drain.seconds == pytest.approx(0.5 + rollouts.DRAIN_POLL_SECONDS)
