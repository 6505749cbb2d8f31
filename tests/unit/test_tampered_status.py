"""The status is output, never input (issue 39, finding 4): what a restarted operator reads
back of `status.settings.served` (the settings canary replicas return to) must be settings a
profile of the API renders to, so that whoever may write `batchpolicies/status` cannot have a
rollback load engine arguments or config parameters no policy could ask for."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchpilot.api.v1alpha1 import specs, statuses
from batchpilot.applying import canaries
from batchpilot.policy import rendering

PROFILES = {
    "bulk": {"maxQueueDelayMicroseconds": 50000, "preferredBatchSizes": [64, 128]},
    "llm": {
        "maxQueueDelayMicroseconds": 100,
        "llm": {"maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "chunkedPrefill": True},
    },
    "tensorrt": {"llm": {"batchSchedulerPolicy": "maxUtilization", "maxTokensInPagedKvCache": 8}},
    "priorities": {
        "maxBatchSize": 32,
        "preserveOrdering": True,
        "priorityLevels": 3,
        "defaultPriorityLevel": 2,
        "queuePolicy": {"timeoutAction": "DELAY", "maxQueueSize": 10},
        "priorityQueuePolicy": [{"priorityLevel": 1, "defaultTimeoutMicroseconds": 500}],
    },
}


def served(profile: str, document: dict[str, Any]) -> canaries.CanaryMemory:
    """A new operator's memory, resumed from a status that says `profile` was served so."""
    memory = canaries.CanaryMemory()
    memory.resume(
        statuses.BatchPolicyStatus.model_validate(
            {
                "settings": {
                    "servedProfile": profile,
                    "servedHash": "0123456789ab",
                    "served": json.dumps(document),
                }
            }
        )
    )
    return memory


def rendered(profile: str, **delay: int) -> rendering.Settings:
    return rendering.render(specs.Profile.model_validate(PROFILES[profile]), **delay)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_settings_a_profile_renders_to_are_resumed_as_they_were(profile: str) -> None:
    settings = rendered(profile)
    memory = served(profile, rendering.settings_document(settings))
    assert memory.served is not None
    assert memory.served.settings == settings


def test_an_autotuned_or_guarded_delay_is_resumed_too() -> None:
    tuned = rendered("bulk", queue_delay_microseconds=12345)
    assert served("bulk", rendering.settings_document(tuned)).served is not None
    held = rendering.Settings(tuned.dynamic_batching, tuned.max_batch_size)
    assert served("bulk", rendering.settings_document(held)).served is not None


@pytest.mark.parametrize(
    ("where", "tamper"),
    [
        ("engineArguments", {"trust_remote_code": True}),
        ("engineArguments", {"model": "attacker/remote-code-model"}),
        ("tensorrtLlmParameters", {"gpt_model_path": "/tmp/attacker"}),
        ("dynamicBatching", {"max_queue_delay_microseconds": 10**12}),
        ("dynamicBatching", {"preferred_batch_size": ["64; rm -rf /"]}),
    ],
)
def test_a_tampered_served_document_is_not_trusted(where: str, tamper: dict[str, Any]) -> None:
    """The next full rollout records the served settings again; nothing of the status's is
    ever loaded."""
    document = rendering.settings_document(rendered("llm"))
    document[where] = {**(document[where] or {}), **tamper}
    memory = served("llm", document)
    assert memory.served is None
