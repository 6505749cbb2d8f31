"""Canaries of new settings (spec.rollout.canary) on real Triton Pods under load, judged from
their sidecars, by the operator as its own process."""

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest

from batchpilot_testbed import clients, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("triton_pods")]

CANARY = {"replicas": 1, "analysisSeconds": 15, "minRequests": 100, "maxP95Ratio": 3}
"""A short window; a latency limit far from what a good change does on a busy machine, and
far below what the bad one does (a 400 ms queue delay against 25 ms: about 15x)."""
GOOD_DELAY, BAD_DELAY = 25_000, 400_000


def with_bulk_delay(document: dict[str, Any], delay: int) -> dict[str, Any]:
    edited = copy.deepcopy(document)
    edited["spec"]["profiles"]["bulk"]["maxQueueDelayMicroseconds"] = delay
    return edited


def canary_in(
    kube: Kube, namespace: str, phase: str, *, not_of: str | None = None
) -> Callable[[], dict[str, Any] | None]:
    """A check for the policy's canary in `phase`, of settings other than `not_of`'s hash."""

    def check() -> dict[str, Any] | None:
        canary = operators.canary_status(kube, namespace, "fleet")
        fresh = not_of is None or canary.get("settingsHash") != not_of
        return canary if canary.get("phase") == phase and fresh else None

    return check


@pytest.mark.timeout(300)
def test_a_good_change_is_promoted_and_a_bad_one_rolled_back_and_not_tried_again(
    kube: Kube, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    ips = fleet.start_tritons(kube, namespace, 3)
    start_operator(interval=1.0)
    document = fleet.policy(rollout={"maxUnavailable": 1, "canary": CANARY})
    operators.apply_policy(kube, namespace, document)
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    load = clients.PodArrivals(ips, rate=30, seconds=150)
    time.sleep(6)  # the sidecars' 5-s rate windows fill

    good = with_bulk_delay(document, GOOD_DELAY)
    operators.apply_policy(kube, namespace, good)
    promoted = waiting.wait_for(
        "the good change promoted", canary_in(kube, namespace, "Promoted"), timeout=90
    )
    print(f"promotion seen at {load.now():.2f}s of the load")
    waiting.wait_for(
        "the good delay everywhere",
        lambda: all(fleet.queue_delay(ip) == GOOD_DELAY for ip in ips.values()),
        timeout=60,
    )
    print(f"\npromoted: {promoted['figures']}")

    operators.apply_policy(kube, namespace, with_bulk_delay(document, BAD_DELAY))
    trial = waiting.wait_for(
        "the bad change's canary",
        lambda: (
            canary_in(kube, namespace, "Analysing", not_of=promoted["settingsHash"])()
            or canary_in(kube, namespace, "RolledBack", not_of=promoted["settingsHash"])()
        ),
        timeout=30,
    )
    canary_pod = trial["replicas"][0]
    others_on_bad: set[str] = set()

    def rolled_back() -> dict[str, Any] | None:
        for name, ip in ips.items():
            if name != canary_pod and fleet.queue_delay(ip) == BAD_DELAY:
                others_on_bad.add(name)
        return canary_in(kube, namespace, "RolledBack", not_of=promoted["settingsHash"])()

    verdict = waiting.wait_for("the bad change rolled back", rolled_back, timeout=90)
    print(f"verdict seen at {load.now():.2f}s of the load")
    print(f"rolled back: {verdict['reason']} ({verdict['figures']})")
    assert verdict["reason"].startswith("p95 "), verdict
    assert others_on_bad == set(), "only the canary took the bad settings"
    waiting.wait_for(
        "the canary back on the fleet's delay",
        lambda: fleet.queue_delay(ips[canary_pod]) == GOOD_DELAY,
        timeout=30,
    )

    status = operators.policy_status(kube, namespace, "fleet")
    assert [entry["profile"] for entry in status["settings"]["failed"]] == ["bulk"]
    assert operators.condition(status, "CanaryFailed")["status"] == "True"
    assert operators.events(kube, namespace, "CanaryPromoted")
    assert operators.events(kube, namespace, "CanaryRolledBack")
    # Five of the operator's ticks: the failed settings stay off the canary and its verdict.
    until = time.monotonic() + 5
    while time.monotonic() < until:
        assert fleet.queue_delay(ips[canary_pod]) == GOOD_DELAY, "the bad settings tried again"
        canary = operators.policy_status(kube, namespace, "fleet")["canary"]
        assert (canary["phase"], canary["settingsHash"]) == ("RolledBack", verdict["settingsHash"])
        time.sleep(0.5)
    assert all(fleet.queue_delay(ip) == GOOD_DELAY for ip in ips.values())

    records = load.stop()
    assert records, "no request was sent"
    failed = [record for record in records if not record.succeeded]
    seen = [(round(record.scheduled, 2), record.error) for record in failed[:8]]
    assert not failed, f"{len(failed)} failed: {seen}"
