"""Profiles rendered into Triton's model configuration, in its JSON form.

The rendering is complete: every field of `dynamic_batching` is written out, with Triton's own
default where the profile leaves it unset. The result depends only on the profile, so it can be
compared with what a server reports and applied idempotently.

A profile's `llm` section is rendered for both LLM backends, each under its own names: vLLM's
engine arguments, and TensorRT-LLM's config parameters, which that backend reads as strings
(`inflight_batcher_llm/src/model_state.cc`: integers by `std::stoi`, booleans from
"true"/"false"). Which backend serves a model is known only when a server is read, so each
backend takes the rendering it understands and refuses the fields it has no setting for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from batchpilot.api.v1alpha1 import specs


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
    tensorrt_llm_parameters: dict[str, str] | None = None
    """For models served by Triton's TensorRT-LLM backend: the config parameters the profile
    sets, with their values as the backend parses them; None when the profile has no `llm`
    section."""
    llm_fields: frozenset[str] = frozenset()
    """The fields the profile's `llm` section sets (camelCase), so that a backend can refuse
    those it has no setting for."""


VLLM_FIELDS = frozenset({"maxNumSeqs", "maxNumBatchedTokens", "chunkedPrefill"})
"""The `llm` fields Triton's vLLM backend takes (as engine arguments)."""
TENSORRT_LLM_FIELDS = frozenset(
    {"chunkedPrefill", "batchSchedulerPolicy", "maxTokensInPagedKvCache"}
)
"""The `llm` fields Triton's TensorRT-LLM backend takes (as config parameters)."""
BATCH_SCHEDULER_POLICIES = {
    "maxUtilization": "max_utilization",
    "guaranteedNoEvict": "guaranteed_no_evict",
}
"""batchSchedulerPolicy as the TensorRT-LLM backend spells it; it takes any other value for its
default, with only a warning in its log."""


def llm_fields(llm: specs.LlmEngine) -> frozenset[str]:
    """The fields an `llm` section sets, by their camelCase names."""
    return frozenset(
        field.alias or name
        for name, field in specs.LlmEngine.model_fields.items()
        if getattr(llm, name) is not None
    )


def tensorrt_llm_parameters(llm: specs.LlmEngine) -> dict[str, str]:
    """The fields set that the TensorRT-LLM backend takes, as its config parameters."""
    named = {
        "enable_chunked_context": (
            None if llm.chunked_prefill is None else str(llm.chunked_prefill).lower()
        ),
        "batch_scheduler_policy": (
            None
            if llm.batch_scheduler_policy is None
            else BATCH_SCHEDULER_POLICIES[llm.batch_scheduler_policy]
        ),
        "max_tokens_in_paged_kv_cache": (
            None
            if llm.max_tokens_in_paged_kv_cache is None
            else str(llm.max_tokens_in_paged_kv_cache)
        ),
    }
    return {name: value for name, value in named.items() if value is not None}


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
        tensorrt_llm_parameters=(
            None if profile.llm is None else tensorrt_llm_parameters(profile.llm)
        ),
        llm_fields=frozenset() if profile.llm is None else llm_fields(profile.llm),
    )


def settings_document(settings: Settings) -> dict[str, Any]:
    """Settings as a JSON object (what a status keeps of them); `from_status` reads it back."""
    return {
        "dynamicBatching": settings.dynamic_batching,
        "maxBatchSize": settings.max_batch_size,
        "engineArguments": settings.engine_arguments,
        "tensorrtLlmParameters": settings.tensorrt_llm_parameters,
        "llmFields": sorted(settings.llm_fields),
    }


def from_document(document: dict[str, Any]) -> Settings:
    """Settings from `settings_document`'s JSON object; raises KeyError or TypeError on any
    other."""
    return Settings(
        dynamic_batching=dict(document["dynamicBatching"]),
        max_batch_size=document["maxBatchSize"],
        engine_arguments=document["engineArguments"],
        tensorrt_llm_parameters=document["tensorrtLlmParameters"],
        llm_fields=frozenset(document["llmFields"]),
    )


def settings_hash(settings: Settings) -> str:
    """A short name for what a model is asked to run: equal settings, equal hash, whichever
    profile they come from."""
    canonical = json.dumps(settings_document(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


_QUEUE_POLICY_FIELDS = {
    "timeout_action": "timeoutAction",
    "default_timeout_microseconds": "defaultTimeoutMicroseconds",
    "allow_timeout_override": "allowTimeoutOverride",
    "max_queue_size": "maxQueueSize",
}
_BATCH_SCHEDULER_POLICY_NAMES = {value: name for name, value in BATCH_SCHEDULER_POLICIES.items()}


def _llm_section(document: dict[str, Any]) -> dict[str, Any] | None:
    """The `llm` section whose rendering `document` would be, by the fields it says it sets."""
    engine, tensorrt = document["engineArguments"], document["tensorrtLlmParameters"]
    if engine is None and tensorrt is None:
        return None
    where: dict[str, Callable[[], Any]] = {
        "maxNumSeqs": lambda: engine["max_num_seqs"],
        "maxNumBatchedTokens": lambda: engine["max_num_batched_tokens"],
        "chunkedPrefill": lambda: engine["enable_chunked_prefill"],
        "batchSchedulerPolicy": lambda: _BATCH_SCHEDULER_POLICY_NAMES[
            tensorrt["batch_scheduler_policy"]
        ],
        "maxTokensInPagedKvCache": lambda: int(tensorrt["max_tokens_in_paged_kv_cache"]),
    }
    return {field: where[field]() for field in document["llmFields"]}


def _profile_document(document: dict[str, Any]) -> dict[str, Any]:
    batching = document["dynamicBatching"]

    def queue_policy(policy: dict[str, Any]) -> dict[str, Any]:
        return {camel: policy[name] for name, camel in _QUEUE_POLICY_FIELDS.items()}

    return {
        "maxQueueDelayMicroseconds": batching["max_queue_delay_microseconds"],
        "preferredBatchSizes": batching["preferred_batch_size"],
        "maxBatchSize": document["maxBatchSize"],
        "preserveOrdering": batching["preserve_ordering"],
        "priorityLevels": batching["priority_levels"] or None,
        "defaultPriorityLevel": batching["default_priority_level"] or None,
        "queuePolicy": queue_policy(batching["default_queue_policy"]),
        "priorityQueuePolicy": [
            {"priorityLevel": int(level), **queue_policy(policy)}
            for level, policy in batching["priority_queue_policy"].items()
        ],
        "llm": _llm_section(document),
    }


def from_status(document: Any) -> Settings | None:
    """Settings a status says were served, if some profile of the API renders to exactly them;
    else None.

    The status is anyone's to write who may write `batchpolicies/status`, so what it holds is
    read back as a profile, through the spec's own model and bounds, and rendered again: engine
    arguments or config parameters no profile can ask for (another model, trust_remote_code)
    never reach a model through it."""
    try:
        profile = specs.Profile.model_validate(_profile_document(document))
    except (pydantic.ValidationError, KeyError, TypeError, ValueError, AttributeError):
        return None
    settings = render(profile)
    return settings if settings_document(settings) == document else None
