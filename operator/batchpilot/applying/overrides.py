"""The configuration override a profile becomes: a profile's settings merged into the model
configuration a Triton server reports, and the check that the merge is one the model can take.

Triton replaces a model's whole configuration on a load with a config override, so batchpilot
always starts from the configuration the server reports and changes only `dynamic_batching`,
`max_batch_size` and its two parameters (`batchpilot_triton.modelconfigs` names them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs
from batchpilot_triton.modelconfigs import ModelConfig

# Triton's defaults for the dynamic_batching fields batchpilot renders; a served config may
# leave some out.
_BATCHING_DEFAULTS: dict[str, Any] = {
    "preferred_batch_size": [],
    "max_queue_delay_microseconds": 0,
    "preserve_ordering": False,
    "priority_levels": 0,
    "default_priority_level": 0,
    "default_queue_policy": {
        "timeout_action": "REJECT",
        "default_timeout_microseconds": 0,
        "allow_timeout_override": False,
        "max_queue_size": 0,
    },
    "priority_queue_policy": {},
}


class ProfileRefused(ValueError):
    """A profile that cannot work on a model; nothing was applied."""


@dataclass(frozen=True)
class Override:
    """What the served configuration should say once a profile is applied, and the files the
    load sends with it (none: the model's own files in the repository)."""

    config: ModelConfig
    profile: str
    files: dict[str, bytes] = field(default_factory=dict)
    """Triton's `file:` overrides of the load request, by their `file:<version>/<name>` key."""


def check(config: ModelConfig, settings: rendering.Settings, *, model: str) -> None:
    """Refuse, before anything is applied, a profile the model cannot take."""
    baseline = modelconfigs.baseline_max_batch_size(config)
    if baseline <= 0:
        raise ProfileRefused(
            f"model {model!r} has max_batch_size 0: it does not batch, so dynamic batching "
            "cannot be configured"
        )
    if settings.max_batch_size is not None and settings.max_batch_size > baseline:
        raise ProfileRefused(
            f"maxBatchSize {settings.max_batch_size} is above model {model!r}'s own "
            f"max_batch_size {baseline}"
        )
    limit = settings.max_batch_size or baseline
    too_big = [size for size in settings.dynamic_batching["preferred_batch_size"] if size > limit]
    if too_big:
        raise ProfileRefused(
            f"preferred batch sizes {too_big} exceed model {model!r}'s max_batch_size {limit}"
        )


def merge(
    config: ModelConfig, settings: rendering.Settings, *, profile: str, model: str
) -> Override:
    """The served configuration with the profile applied; raises ProfileRefused."""
    check(config, settings, model=model)
    baseline = modelconfigs.baseline_max_batch_size(config)
    merged = copy.deepcopy(config)
    merged["max_batch_size"] = settings.max_batch_size or baseline
    dynamic_batching = copy.deepcopy(settings.dynamic_batching)
    # Triton fills an empty list with [max_batch_size]; writing that out keeps what we send
    # equal to what the server reports, so an unchanged profile never reloads.
    if not dynamic_batching["preferred_batch_size"]:
        dynamic_batching["preferred_batch_size"] = [merged["max_batch_size"]]
    merged["dynamic_batching"] = dynamic_batching
    parameters = dict(merged.get("parameters") or {})
    parameters[modelconfigs.PROFILE_PARAMETER] = {"string_value": profile}
    parameters[modelconfigs.BASELINE_PARAMETER] = {"string_value": str(baseline)}
    merged["parameters"] = parameters
    return Override(config=merged, profile=profile)


def _comparable(config: ModelConfig) -> dict[str, Any]:
    served = config.get("dynamic_batching") or {}
    batching = {key: served.get(key, default) for key, default in _BATCHING_DEFAULTS.items()}
    batching["preferred_batch_size"] = sorted(batching["preferred_batch_size"])
    return {
        "max_batch_size": int(config.get("max_batch_size", 0)),
        "dynamic_batching": batching,
        "profile": modelconfigs.applied_profile(config),
        # A baseline that is not the one the merge writes (a malformed one) is written afresh.
        "baseline": modelconfigs.parameter(config, modelconfigs.BASELINE_PARAMETER),
    }


def matches(served: ModelConfig, wanted: Override) -> bool:
    """Whether the server already runs the wanted configuration (no reload needed)."""
    return _comparable(served) == _comparable(wanted.config)
