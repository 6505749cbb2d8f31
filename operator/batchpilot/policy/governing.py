"""Which policy governs a Pod that several policies select.

Two policies that both select a Pod would each switch it to their own profile on every pass, so
the Pod would flap between them for as long as both exist. One of them governs it instead: the
oldest (by creation time, then by name, so the choice is the same in every pass and every
operator replica), and it does not change when a newer policy starts selecting the Pod too. The
others leave the Pod alone and say so in a condition and an event, until the overlap is gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Governor:
    """A policy as the Pods it selects see it."""

    name: str
    created: str
    """Its creation time as the API writes it (RFC 3339, UTC, so text order is time order);
    empty when unknown, which counts as the oldest."""
    selector: Mapping[str, Any]
    """Its spec.target.selector, as the API holds it."""

    @property
    def seniority(self) -> tuple[str, str]:
        return (self.created, self.name)


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Label-selector semantics, as the API's own label selection: an empty selector selects
    every Pod."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for requirement in selector.get("matchExpressions") or []:
        key, operator, values = (
            requirement["key"],
            requirement["operator"],
            requirement.get("values") or [],
        )
        present = key in labels
        if (
            (operator == "In" and labels.get(key) not in values)
            or (operator == "NotIn" and present and labels[key] in values)
            or (operator == "Exists" and not present)
            or (operator == "DoesNotExist" and present)
        ):
            return False
    return True


def governor(policies: Sequence[Governor], labels: Mapping[str, str]) -> Governor | None:
    """The policy that governs a Pod with these labels: the oldest of those that select it. A
    policy with an empty selector governs nothing (the API refuses one; one stored before it
    did is an invalid spec)."""
    selecting = [
        policy
        for policy in policies
        if _names_a_label(policy.selector) and selects(policy.selector, labels)
    ]
    return min(selecting, key=lambda policy: policy.seniority, default=None)


def _names_a_label(selector: Mapping[str, Any]) -> bool:
    return bool(selector.get("matchLabels") or selector.get("matchExpressions"))


def contest(
    name: str, policies: Sequence[Governor], labels: Mapping[str, str], *, pod: str
) -> str | None:
    """Why policy `name` must leave a Pod it selects alone; None when it governs it."""
    winner = governor(policies, labels)
    if winner is None or winner.name == name:
        return None
    return (
        f"{pod} is governed by policy {winner.name!r}, which selects it too and is older; "
        "this policy leaves it alone"
    )


@dataclass(frozen=True)
class Limits:
    """What one tenant may take of the operator every namespace shares (the chart's
    operator.limits): a namespace's policies beyond the oldest `policies_per_namespace` govern
    no Pod, and a policy governs at most `pods_per_policy` Pods (the first by name). Either
    is said in the policy's LimitExceeded condition."""

    policies_per_namespace: int = 100
    pods_per_policy: int = 500
