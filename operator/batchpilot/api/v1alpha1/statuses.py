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
    "PodsNotInjected",
    "LimitExceeded",
    "CredentialRefused",
    "CanaryFailed",
]
TargetState = Literal["Updated", "Pending", "Draining", "Applying", "Failed", "Unreachable"]
CanaryPhase = Literal["Rolling", "Analysing", "Promoted", "RolledBack", "Inconclusive"]


class Condition(Model):
    """The latest observation of one aspect of the policy's state."""

    type: Annotated[str, Field(max_length=64)]
    """Ready, Progressing (True while a rollout to a newly decided profile runs, RollingOut;
    while minDwellSeconds holds the desired profile back, DwellHolding; or while targets wait,
    RolloutPending), Degraded, InvalidSpec, SignalsUnavailable, LeadTimeInsufficient,
    DrainIneffective, PodsContested (Pods it selects that an older policy governs),
    PodsNotInjected (Pods it selects that opted into the admission webhook but were created while
    it did not answer, so batchpilot cannot switch them), LimitExceeded (the operator's limits of
    policies per namespace or Pods per policy leave Pods out), CredentialRefused or CanaryFailed
    (the decided settings failed their canary)."""
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


SettingsHash = Annotated[str, Field(max_length=64)]


class FailedSettings(Model):
    """Settings that failed their canary: not tried again until the spec changes."""

    settings_hash: SettingsHash
    """The settings' hash (settingsHash of status.canary)."""
    profile: Annotated[str, Field(max_length=63)]
    """The profile they were the settings of."""
    generation: int | None = None
    """The spec generation they failed under; a new generation tries them again."""
    reason: Annotated[str, Field(max_length=1024)] = ""
    """The canary's verdict, with its figures."""
    failed_at: AwareDatetime | None = None
    """When the verdict came."""


class SettingsHistory(Model):
    """Which settings the fleet has served, for rollout.canary."""

    served_profile: Annotated[str, Field(max_length=63)] | None = None
    """The profile the whole fleet last served."""
    served_hash: SettingsHash | None = None
    """The hash of the settings it served them with."""
    served: Annotated[str, Field(max_length=16384)] = ""
    """Those settings, as JSON: what canary replicas return to when new settings fail."""
    proven: list[SettingsHash] = Field(default_factory=list, max_length=16)
    """Hashes of settings the fleet served (the most recent last): these roll straight on."""
    failed: list[FailedSettings] = Field(default_factory=list, max_length=16)
    """Settings that failed their canary under the current spec."""


class CanaryStatus(Model):
    """The latest canary: which replicas, since when, the figures so far, the verdict and why."""

    profile: Annotated[str, Field(max_length=63)]
    """The profile whose new settings are on trial."""
    settings_hash: SettingsHash
    """A short hash of the settings on trial (Triton's dynamic_batching, the batch-size cap,
    the LLM engine's arguments)."""
    replicas: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list, max_length=100
    )
    """The canary replicas' Pods."""
    phase: CanaryPhase
    """Rolling (the canary replicas take the settings), Analysing, or the verdict: Promoted,
    RolledBack, Inconclusive."""
    started_at: AwareDatetime | None = None
    """When the analysis began: every canary replica serving the settings."""
    figures: Annotated[str, Field(max_length=1024)] = ""
    """The window's figures so far: requests and failure rates on both sides, latency ratios."""
    reason: Annotated[str, Field(max_length=1024)] = ""
    """Why the verdict, or what the canary waits for."""
    verdict_time: AwareDatetime | None = None
    """When the verdict came."""


class BatchPolicyStatus(Model):
    """What the operator decided and how far the fleet has followed."""

    active_profile: str | None = None
    """The profile in force: decided, and rolled out (a rollout that failed on some targets
    included: see targets). Set when a pass's rollout ends."""
    desired_profile: str | None = None
    """The profile the rules ask for; differs from activeProfile while minDwellSeconds holds,
    and while a rollout to it runs (the Progressing condition says which)."""
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
    """How long one wave of a rollout takes, as leadTime auto plans for it: the longest of the
    policy's recent waves and of the waves of other rollouts that ran beside them on the same
    nodes (simultaneous reloads share a node's cores and GPUs)."""
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
    DrainIneffective, PodsContested, PodsNotInjected, LimitExceeded, CredentialRefused and
    CanaryFailed."""
    settings: SettingsHistory | None = None
    """Which settings the fleet served, proved and failed (with rollout.canary)."""
    canary: CanaryStatus | None = None
    """The latest canary (with rollout.canary)."""
    observed_generation: int | None = None
    """The spec generation this status describes."""
