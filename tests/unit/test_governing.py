"""Which policy governs a Pod that several select: the oldest, then by name, whatever order the
policies are listed in; a policy with an empty selector governs nothing."""

from __future__ import annotations

import pytest

from batchpilot.policy import governing

TRITON = {"matchLabels": {"app": "triton"}}
LABELS = {"app": "triton", "tier": "gpu"}


def policy(name: str, created: str, selector: dict[str, object] = TRITON) -> governing.Governor:
    return governing.Governor(name=name, created=created, selector=selector)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_oldest_selecting_policy_governs_then_the_first_by_name(reverse: bool) -> None:
    policies = [
        policy("b", "2026-01-01T00:00:00Z"),
        policy("a", "2026-01-01T00:00:00Z"),
        policy("older-elsewhere", "2025-01-01T00:00:00Z", {"matchLabels": {"app": "other"}}),
        policy("newer", "2026-03-01T00:00:00Z"),
    ]
    ordered = list(reversed(policies)) if reverse else policies
    assert governing.governor(ordered, LABELS) == policies[1]
    assert governing.contest("a", ordered, LABELS, pod="pod p") is None
    assert governing.contest("newer", ordered, LABELS, pod="pod p") == (
        "pod p is governed by policy 'a', which selects it too and is older; "
        "this policy leaves it alone"
    )


def test_a_policy_with_an_empty_selector_governs_nothing() -> None:
    policies = [policy("everything", "2020-01-01T00:00:00Z", {}), policy("desk", "2026-01-01Z")]
    assert governing.governor(policies, LABELS) == policies[1]
    assert governing.selects({}, LABELS)  # the API's meaning, for whom to poke


def test_a_pod_no_policy_selects_is_nobody_s_and_contests_nothing() -> None:
    policies = [policy("desk", "2026-01-01T00:00:00Z")]
    assert governing.governor(policies, {"app": "other"}) is None
    assert governing.contest("desk", policies, {"app": "other"}, pod="pod p") is None
    assert governing.contest("runner", (), LABELS, pod="pod p") is None
