"""What one tenant may take of the shared operator (issue 39, finding 5): a namespace's
policies beyond the oldest `--max-policies-per-namespace` govern no Pod, a policy governs at
most `--max-pods-per-policy` Pods; each is said in a LimitExceeded condition and an event, and
nothing fails. (The Pod watch's memory, flat in Pods no policy governs, is issue 42.)"""

from __future__ import annotations

from typing import Any

import pytest
from operator_fakes import FakeFleet, FakeGates, FakePods, FakeServer, target

from batchpilot import cli, reconciling, telemetry
from batchpilot.applying.replicas import Replica
from batchpilot.policy import governing
from builders import spec_document, utc

NOW = utc(2026, 11, 24, 15)
SELECTOR = {"matchLabels": {"app": "triton"}}


def reconciler(
    targets: list[Replica],
    fleet: FakeFleet,
    limits: governing.Limits,
    policies: list[tuple[str, dict[str, Any]]],
) -> reconciling.Reconciler:
    """`policies`: every policy of the namespace, oldest first, with its selector."""
    governors = [
        governing.Governor(name=name, created=f"2026-01-0{n + 1}T00:00:00Z", selector=selector)
        for n, (name, selector) in enumerate(policies)
    ]
    return reconciling.Reconciler(
        replicas=FakePods(targets),
        gates=FakeGates(),
        fleet=fleet,
        signal_source=lambda namespace, policy, found: _NoSignals(),
        metrics=telemetry.controller_metrics(),
        clock=lambda: NOW,
        settle_seconds=0,
        governors=lambda namespace: governors,
        limits=limits,
    )


class _NoSignals:
    async def read(self) -> Any:
        raise AssertionError("the base spec reads no signals")

    async def close(self) -> None:
        pass


async def reconcile(subject: reconciling.Reconciler, name: str) -> reconciling.Reconciled:
    return await subject.reconcile(
        namespace="ns",
        name=name,
        spec=spec_document(),
        status={},
        generation=1,
        state=reconciling.PolicyMemory(),
    )


def condition(outcome: reconciling.Reconciled, kind: str) -> tuple[str, str, str]:
    (found,) = [c for c in outcome.status["conditions"] if c["type"] == kind]
    return found["status"], found["reason"], found["message"]


@pytest.mark.looptime
async def test_a_policy_governs_at_most_its_limit_of_pods_the_first_by_name() -> None:
    targets = [target(f"triton-{n}") for n in range(5)]
    fleet = FakeFleet({t.http_url: FakeServer() for t in targets})
    limits = governing.Limits(pods_per_policy=3)
    outcome = await reconcile(reconciler(targets, fleet, limits, [("fleet", SELECTOR)]), "fleet")
    switched = sorted(t.name for t in targets if fleet.servers[t.http_url].profile == "bulk")
    assert switched == ["triton-0", "triton-1", "triton-2"]
    status, reason, message = condition(outcome, "LimitExceeded")
    assert (status, reason) == ("True", "LimitExceeded")
    assert "governs 5 Pods, more than the operator's limit of 3" in message
    assert "LimitExceeded" in [event.reason for event in outcome.events]
    assert outcome.status["targets"]["total"] == 3


@pytest.mark.looptime
async def test_a_namespace_s_policies_beyond_its_limit_govern_nothing_the_older_ones_do() -> None:
    targets = [target("triton-0")]
    fleet = FakeFleet({t.http_url: FakeServer() for t in targets})
    limits = governing.Limits(policies_per_namespace=2)
    elsewhere = {"matchLabels": {"app": "elsewhere"}}
    # The newest selects the Pod alone: only the limit keeps it from governing it.
    policies = [("first", elsewhere), ("second", elsewhere), ("third", SELECTOR)]
    newest = await reconcile(reconciler(targets, fleet, limits, policies), "third")
    assert fleet.servers[targets[0].http_url].profile is None
    status, reason, message = condition(newest, "LimitExceeded")
    assert (status, reason) == ("True", "LimitExceeded")
    assert "more than 2 policies" in message
    assert condition(newest, "PodsContested")[0] == "False"
    older = [("first", elsewhere), ("third", SELECTOR), ("second", elsewhere)]
    within = await reconcile(reconciler(targets, fleet, limits, older), "third")
    assert condition(within, "LimitExceeded")[:2] == ("False", "WithinLimits")
    assert fleet.servers[targets[0].http_url].profile == "bulk"


def test_the_limits_are_options_of_the_operator_with_documented_defaults() -> None:
    parser = cli.build_parser()
    defaults = parser.parse_args(["operator"])
    assert (defaults.max_policies_per_namespace, defaults.max_pods_per_policy) == (100, 500)
    given = parser.parse_args(
        ["operator", "--max-policies-per-namespace", "7", "--max-pods-per-policy", "9"]
    )
    assert (given.max_policies_per_namespace, given.max_pods_per_policy) == (7, 9)
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "--max-pods-per-policy", "0"])
