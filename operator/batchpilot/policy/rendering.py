"""Profiles rendered into Triton's model configuration, in its JSON form.

The rendering is complete: every field of `dynamic_batching` is written out, with Triton's own
default where the profile leaves it unset. The result depends only on the profile, so it can be
compared with what a server reports and applied idempotently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchpilot.policy import specs


@dataclass(frozen=True)
class Settings:
    """What a profile asks of one Triton model."""

    dynamic_batching: dict[str, Any]
    """Triton's `dynamic_batching` message, in the model-configuration JSON form."""
    max_batch_size: int | None
    """The cap on the model's max_batch_size, when the profile sets one."""
    engine_arguments: dict[str, Any] | None = None
    """For models served by an LLM engine: the engine arguments the profile sets, under vLLM's
    names; None when the profile has no `llm` section."""


def _queue_policy(policy: specs.QueuePolicy | None) -> dict[str, Any]:
    policy = policy or specs.QueuePolicy()
    return {
        "timeout_action": policy.timeout_action,
        "default_timeout_microseconds": policy.default_timeout_microseconds,
        "allow_timeout_override": policy.allow_timeout_override,
        "max_queue_size": policy.max_queue_size,
    }


def render(profile: specs.Profile, *, queue_delay_microseconds: int | None = None) -> Settings:
    """The Triton settings for `profile`; `queue_delay_microseconds` replaces its delay
    (SLO autotune)."""
    delay = (
        profile.max_queue_delay_microseconds
        if queue_delay_microseconds is None
        else queue_delay_microseconds
    )
    dynamic_batching: dict[str, Any] = {
        "preferred_batch_size": sorted(profile.preferred_batch_sizes),
        "max_queue_delay_microseconds": delay,
        "preserve_ordering": bool(profile.preserve_ordering),
        "priority_levels": profile.priority_levels or 0,
        "default_priority_level": profile.default_priority_level or 0,
        "default_queue_policy": _queue_policy(profile.queue_policy),
        "priority_queue_policy": {
            str(policy.priority_level): _queue_policy(policy)
            for policy in sorted(profile.priority_queue_policy, key=lambda p: p.priority_level)
        },
    }
    return Settings(
        dynamic_batching=dynamic_batching,
        max_batch_size=profile.max_batch_size,
        engine_arguments=None if profile.llm is None else profile.llm.engine_arguments(),
    )
