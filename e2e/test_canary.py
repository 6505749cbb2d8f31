"""Canaries of new settings (spec.rollout.canary) on real Triton Pods under load, judged from
their sidecars, by the operator as its own process."""

import copy
import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest

from batchpilot_testbed import clients, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("triton_pods")]

CANARY = {"replicas": 1, "analysisSeconds": 20, "minRequests": 100, "maxP95Ratio": 5}
"""A short window; a latency limit far from what a good change does on a busy machine (25 ms
against 20 ms measured up to 2x there: at tens of milliseconds the machine's noise is most of
the p95), and far below what the bad one does."""
GOOD_DELAY, BAD_DELAY = 25_000, 3_500_000
BAD_PREFERRED = [128]
"""The bad change holds every request about 3.5 s: a batch of 128 (gpu_sim's largest) takes over
4 s to arrive at 30 requests a second, so a client that a busy machine makes send in bursts
cannot fill one early, and the others' p95 would have to pass 700 ms for it to measure under
5x (with 2 s, on a machine loaded beyond a busy core, the others' p95 reached 530 ms and the
bad change was promoted at 3.77x). What the canary's queue holds when a reading is taken
counts as arrived (Triton's pending gauge), so a long delay is judged by its p95, not taken
for refusals."""


def with_bulk_delay(
    document: dict[str, Any], delay: int, preferred: list[int] | None = None
) -> dict[str, Any]:
    edited = copy.deepcopy(document)
    edited["spec"]["profiles"]["bulk"]["maxQueueDelayMicroseconds"] = delay
    if preferred is not None:
        edited["spec"]["profiles"]["bulk"]["preferredBatchSizes"] = preferred
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
    load = clients.PodArrivals(ips, rate=30, seconds=280)  # stopped once judged
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

    operators.apply_policy(kube, namespace, with_bulk_delay(document, BAD_DELAY, BAD_PREFERRED))
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
    # Its queue holds each request 2 s: what it still holds when read counts as arrived (Triton's
    # pending gauge), not refused, so the held-up canary is rolled back by its p95, as it should.
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


SWITCH_CANARY = {"replicas": 1, "analysisSeconds": 15, "minRequests": 100}
"""maxP95Ratio at its default (1.5x): bulk's 20 ms queue delay puts its p95 at about twice
interactive's under this load, which a comparison with interactive's replicas fails."""


@pytest.mark.timeout(300)
def test_a_scheduled_first_switch_into_bulk_is_promoted_and_in_force(
    kube: Kube, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    ips = fleet.start_tritons(kube, namespace, 2)
    start_operator(interval=1.0)
    opens, window = fleet.interactive_window("bulk", at_least_seconds=25)
    document = fleet.policy(
        defaultProfile="interactive",
        schedule={"timezone": "UTC", "windows": [window]},
        rollout={"maxUnavailable": 1, "canary": SWITCH_CANARY},
    )
    operators.apply_policy(kube, namespace, document)
    settled = fleet.everyone_serves(ips, "interactive")
    waiting.wait_for("interactive everywhere", settled, timeout=60)
    seconds = (opens - datetime.datetime.now(datetime.UTC)).total_seconds() + 60
    load = clients.PodArrivals(ips, rate=30, seconds=seconds)

    promoted = waiting.wait_for(
        "bulk's canary promoted",
        lambda: (
            canary
            if (canary := operators.canary_status(kube, namespace, "fleet")).get("profile")
            == "bulk"
            and canary.get("phase") in ("Promoted", "RolledBack")
            else None
        ),
        timeout=seconds,
    )
    print(f"\n{promoted['phase']} at {promoted.get('verdictTime')}, the window opened {opens}")
    print(f"{promoted['reason']} ({promoted['figures']})")
    assert promoted["phase"] == "Promoted", promoted
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=30)
    verdict_at = datetime.datetime.fromisoformat(promoted["verdictTime"])
    analysis = datetime.timedelta(seconds=SWITCH_CANARY["analysisSeconds"])
    assert verdict_at >= opens + analysis, "judged over the whole window after the boundary"
    status = operators.policy_status(kube, namespace, "fleet")
    assert status["activeProfile"] == "bulk"
    assert promoted["settingsHash"] in status["settings"]["proven"]
    assert not status["settings"].get("failed")
    records = load.stop()
    failed = [record for record in records if not record.succeeded]
    assert records, "no request was sent"
    assert not failed, f"{len(failed)} failed: {[r.error for r in failed[:5]]}"


REFUSING = {"maxQueueDelayMicroseconds": 50_000, "queuePolicy": {"maxQueueSize": 1}}
"""One request queued at a time while it waits 50 ms for a batch: at 30 requests per second per
Pod, about half the arrivals find it taken and get a 503 that Triton counts nowhere. Its p95
stays within CANARY's 5x of the others', so only its refusals can fail it."""


def max_queue_size(ip: str) -> int | None:
    served = fleet.served_config(ip)
    if served is None:
        return None
    policy = served.get("dynamic_batching", {}).get("default_queue_policy", {})
    return int(policy.get("max_queue_size", 0))


@pytest.mark.timeout(300)
def test_a_profile_whose_queue_refuses_is_rolled_back_on_the_canary_only(
    kube: Kube, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    ips = fleet.start_tritons(kube, namespace, 2)
    start_operator(interval=1.0)
    document = fleet.policy(rollout={"maxUnavailable": 1, "canary": CANARY})
    operators.apply_policy(kube, namespace, document)
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    load = clients.PodArrivals(ips, rate=30, seconds=120)
    time.sleep(6)  # the sidecars' 5-s rate windows fill

    refusing = copy.deepcopy(document)
    refusing["spec"]["profiles"]["bulk"].update(REFUSING)
    operators.apply_policy(kube, namespace, refusing)
    trial = waiting.wait_for(
        "the refusing settings' canary",
        lambda: (
            canary_in(kube, namespace, "Analysing")() or canary_in(kube, namespace, "RolledBack")()
        ),
        timeout=30,
    )
    canary_pod = trial["replicas"][0]
    others_refusing: set[str] = set()

    def rolled_back() -> dict[str, Any] | None:
        for name, ip in ips.items():
            if name != canary_pod and max_queue_size(ip) == 1:
                others_refusing.add(name)
        return canary_in(kube, namespace, "RolledBack")()

    verdict = waiting.wait_for("the refusing settings rolled back", rolled_back, timeout=60)
    print(f"\nrolled back at {load.now():.2f}s of the load: {verdict['reason']}")
    print(f"figures: {verdict['figures']}")
    assert verdict["reason"].startswith("failure rate "), verdict
    assert "refused before Triton counted them" in verdict["reason"]
    assert others_refusing == set(), "only the canary took the refusing settings"
    waiting.wait_for(
        "the canary's queue unbounded again",
        lambda: max_queue_size(ips[canary_pod]) == 0,
        timeout=30,
    )
    assert operators.events(kube, namespace, "CanaryRolledBack")

    records = load.stop()
    canary_url = fleet.triton_url(ips[canary_pod])
    refused = [r for r in records if not r.succeeded and r.server == canary_url]
    elsewhere = [r for r in records if not r.succeeded and r.server != canary_url]
    print(f"client: {len(refused)} requests refused on the canary, {len(elsewhere)} elsewhere")
    assert refused, "the canary's queue refused requests"
    assert not elsewhere, f"{len(elsewhere)} failed elsewhere: {[r.error for r in elsewhere[:5]]}"
