"""The BatchPolicy status, as the operator writes it and `kubectl get bp` shows it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, ConfigDict, Field

from batchpilot.api.v1alpha1 import specs


class Model(specs.Model):
    """Status objects are written by the operator, in Python names; users never write them."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)


ConditionType = Literal[
    "Ready",
    "Progressing",
    "Degraded",
    "InvalidSpec",
    "SignalsUnavailable",
    "LeadTimeInsufficient",
    "DrainIneffective",
    "PodsContested",
    "CredentialRefused",
]
TargetState = Literal["Updated", "Pending", "Draining", "Applying", "Failed", "Unreachable"]


class Condition(Model):
    """The latest observation of one aspect of the policy's state."""

    type: Annotated[str, Field(max_length=64)]
    """Ready, Progressing, Degraded, InvalidSpec, SignalsUnavailable, LeadTimeInsufficient,
    DrainIneffective, PodsContested (Pods it selects that an older policy governs) or
    CredentialRefused."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: Annotated[str, Field(max_length=128)] = ""
    """A CamelCase word for machines."""
    message: Annotated[str, Field(max_length=4096)] = ""
    """What happened, for people."""
    last_transition_time: AwareDatetime | None = None
    """When the status last changed."""
    observed_generation: int | None = None
    """The spec generation the condition describes."""


class TargetStatus(Model):
    """One governed Triton server."""

    name: Annotated[str, Field(max_length=253)]
    """The Pod's name."""
    endpoint: Annotated[str, Field(max_length=512)] = ""
    """Triton's HTTP endpoint, host:port."""
    profile: str | None = None
    """The profile the server is running, as last verified."""
    state: TargetState
    """Updated, Pending, Draining, Applying, Failed or Unreachable."""
    message: Annotated[str, Field(max_length=1024)] = ""
    """Details of the last apply or failure."""
    last_update_time: AwareDatetime | None = None
    """When the state last changed."""


class TargetCounts(Model):
    """How many servers run the active profile."""

    total: int = 0
    """Servers the policy governs."""
    updated: int = 0
    """Servers verified to run the active profile."""
    failed: int = 0
    """Servers whose last apply failed."""
    summary: str = ""
    """The counts as a short text, e.g. "2/3 updated, 1 failed"."""


class BatchPolicyStatus(Model):
    """What the operator decided and how far the fleet has followed."""

    active_profile: str | None = None
    """The profile in force: decided, and rolled out or rolling out."""
    desired_profile: str | None = None
    """The profile the rules ask for; differs from activeProfile while minDwellSeconds holds."""
    reason: Annotated[str, Field(max_length=1024)] = ""
    """Why the active profile applies."""
    last_transition_time: AwareDatetime | None = None
    """When activeProfile last changed."""
    next_transition_time: AwareDatetime | None = None
    """When the decision next changes as far as the clock can tell."""
    planned_rollout_start: AwareDatetime | None = None
    """When the next scheduled change starts rolling out: schedule.leadTime before
    nextTransitionTime for a change into a latency profile, else nextTransitionTime."""
    lead_time_seconds: float | None = None
    """The lead time in force, in seconds (schedule.leadTime, with auto resolved)."""
    measured_wave_seconds: float | None = None
    """How long one wave of a rollout took, the longest of the policy's recent rollouts:
    what leadTime auto is computed from."""
    targets: TargetCounts = TargetCounts()
    """Counts of governed servers by state."""
    target_details: list[TargetStatus] = Field(default_factory=list, max_length=64)
    """Per-server state, for at most 64 servers (the counts cover all)."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Ready, Progressing, Degraded, InvalidSpec, SignalsUnavailable, LeadTimeInsufficient,
    DrainIneffective and CredentialRefused."""
    observed_generation: int | None = None
    """The spec generation this status describes."""
