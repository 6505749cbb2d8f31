"""Reporting a reconcile: the status and events come from its findings alone (no I/O)."""

from __future__ import annotations

import dataclasses
import datetime

from operator_fakes import target

from batchpilot import reporting
from batchpilot.api.v1alpha1 import statuses
from batchpilot.applying import actuators, rollouts
from batchpilot.policy import decisions
from builders import make_spec, utc

NOW = utc(2026, 11, 24, 15)
LATER = NOW + datetime.timedelta(minutes=5)


def findings(*, now: datetime.datetime = NOW, **fields: object) -> reporting.Findings:
    policy = make_spec()
    decision = decisions.decide(policy, now, decisions.Signals(), decisions.Memory())
    replicas = [target("triton-0"), target("triton-1")]
    result = rollouts.Result(
        tuple(rollouts.Outcome(r, "Updated", decision.profile) for r in replicas)
    )
    found = reporting.Findings(
        now=now,
        generation=3,
        policy=policy,
        decision=decision,
        replicas=replicas,
        result=result,
    )
    return dataclasses.replace(found, **fields)  # type: ignore[arg-type]


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    first = reporting.previous_status(reporting.status(findings(), statuses.BatchPolicyStatus()))
    again = reporting.status(findings(now=LATER), first)
    ready = next(c for c in again["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "2026-11-24T15:00:00Z"


def test_a_condition_that_changes_status_takes_the_new_time() -> None:
    first = reporting.previous_status(reporting.status(findings(), statuses.BatchPolicyStatus()))
    failed = rollouts.Result(
        (
            rollouts.Outcome(target("triton-0"), "Updated", "bulk"),
            rollouts.Outcome(target("triton-1"), "Failed", None, "no", error="rejected"),
        )
    )
    again = reporting.status(findings(now=LATER, result=failed), first)
    degraded = next(c for c in again["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["lastTransitionTime"]) == ("True", "2026-11-24T15:05:00Z")
    assert degraded["message"] == "triton-1: no"


def test_an_unparseable_previous_status_counts_as_none() -> None:
    assert reporting.previous_status({"targets": "many"}) == statuses.BatchPolicyStatus()


def test_an_invalid_spec_keeps_what_the_status_said_and_says_why() -> None:
    before = reporting.previous_status(reporting.status(findings(), statuses.BatchPolicyStatus()))
    invalid = reporting.Findings(now=LATER, generation=4, problems=("spec.profiles: required",))
    written = reporting.status(invalid, before)
    assert written["activeProfile"] == "bulk"
    assert written["reason"] == "invalid spec: spec.profiles: required"
    assert written["observedGeneration"] == 4
    conditions = {c["type"]: (c["status"], c["reason"]) for c in written["conditions"]}
    assert conditions["InvalidSpec"] == ("True", "InvalidSpec")
    assert conditions["Ready"] == ("False", "InvalidSpec")


def test_a_standing_problem_is_a_notice_with_a_key_and_its_end_forgets_it() -> None:
    unreachable = rollouts.Outcome(target("triton-1"), "Unreachable", None, "connection refused")
    notice = reporting.target_notice(unreachable)
    assert notice.key == "target/triton-1"
    assert notice.event == reporting.Event(
        "Warning", "TargetUnreachable", "pod triton-1: connection refused"
    )
    healthy = rollouts.Outcome(target("triton-1"), "Updated", "bulk")
    assert reporting.target_notice(healthy) == reporting.Notice(None, key="target/triton-1")


def test_a_rejected_profile_is_reported_as_rolled_back() -> None:
    rejected = rollouts.Outcome(target("triton-0"), "Failed", None, "bad", error="rejected")
    notice = reporting.target_notice(rejected)
    assert notice.event is not None
    assert notice.event.reason == "RolledBack"


def test_rolled_out_is_announced_once_every_replica_runs_the_profile_after_reloads() -> None:
    reload = actuators.Applied("gpu_sim", "bulk", None, True, 0.4)
    switched = rollouts.Outcome(target("triton-0"), "Updated", "bulk", applied=(reload,))
    left_alone = rollouts.Outcome(target("triton-1"), "Updated", "bulk")
    pending = rollouts.Outcome(target("triton-1"), "Pending", None, "rollout halted")
    event = reporting.rolled_out_event(rollouts.Result((switched, left_alone), seconds=1.25))
    assert event == reporting.Event(
        "Normal", "RolledOut", "bulk on 2/2 targets in 1.2s (1 reloads)"
    )
    assert reporting.rolled_out_event(rollouts.Result((switched, pending))) is None
    assert reporting.rolled_out_event(rollouts.Result((left_alone,))) is None, "nothing reloaded"


def test_every_gate_a_container_restart_closed_is_a_warning_each_time() -> None:
    restarted = "pod triton-0: container triton restarted at T; out of its Services until ..."
    found = findings()
    assert found.result is not None
    found = findings(result=dataclasses.replace(found.result, restarts=(restarted,)))
    events = [notice.event for notice in reporting.notices(found) if notice.event is not None]
    assert reporting.Event("Warning", "ContainerRestarted", restarted) in events
