"""Profile roles: what alerts and dashboards use to tell a throughput profile from a latency one."""

from __future__ import annotations

from batchpilot import telemetry
from builders import make_spec

FLEET = telemetry.PolicyLabels("ns", "fleet")


def test_the_profile_with_the_longest_queue_delay_is_the_throughput_profile() -> None:
    spec = make_spec()
    assert spec.profile_role("bulk") == "throughput"
    assert spec.profile_role("interactive") == "latency"


def test_a_declared_role_wins_over_the_queue_delay() -> None:
    spec = make_spec(
        profiles={
            "overnight": {"maxQueueDelayMicroseconds": 1000, "role": "throughput"},
            "desk": {"maxQueueDelayMicroseconds": 5000, "role": "latency"},
        },
        defaultProfile="desk",
    )
    assert spec.profile_role("overnight") == "throughput"
    assert spec.profile_role("desk") == "latency"


def test_profiles_tied_for_the_longest_delay_are_all_latency_profiles() -> None:
    spec = make_spec(
        profiles={"a": {"maxQueueDelayMicroseconds": 100}, "b": {"maxQueueDelayMicroseconds": 100}},
        defaultProfile="a",
    )
    assert {spec.profile_role("a"), spec.profile_role("b")} == {"latency"}


def test_a_lone_profile_is_a_latency_profile() -> None:
    spec = make_spec(profiles={"only": {"maxQueueDelayMicroseconds": 9000}}, defaultProfile="only")
    assert spec.profile_role("only") == "latency"


def test_roles_are_exported_one_series_per_profile_and_follow_an_edit() -> None:
    metrics = telemetry.controller_metrics()
    telemetry.set_roles(metrics, FLEET, make_spec())
    role = metrics.registry.get_sample_value
    bulk = {"policy_namespace": "ns", "policy": "fleet", "profile": "bulk"}
    assert role(telemetry.PROFILE_ROLE, {**bulk, "role": "throughput"})
    edited = make_spec(
        profiles={
            "interactive": {"maxQueueDelayMicroseconds": 2000, "role": "throughput"},
            "bulk": {"maxQueueDelayMicroseconds": 50000, "role": "latency"},
        }
    )
    telemetry.set_roles(metrics, FLEET, edited)
    assert role(telemetry.PROFILE_ROLE, {**bulk, "role": "latency"})
    assert role(telemetry.PROFILE_ROLE, {**bulk, "role": "throughput"}) is None
