"""Merging profiles into Triton model configurations, as the server reports them."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import overrides
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs

# What tritonserver 2.51 reported for manifests/model-repository/gpu_sim (GET .../config).
SERVED: dict[str, Any] = json.loads(
    """{"name": "gpu_sim", "platform": "", "backend": "python", "runtime": "",
    "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": 128,
    "input": [{"name": "INPUT", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [16],
               "is_shape_tensor": false, "allow_ragged_batch": false, "optional": false,
               "is_non_linear_format_io": false}],
    "output": [{"name": "OUTPUT", "data_type": "TYPE_FP32", "dims": [16], "label_filename": "",
                "is_shape_tensor": false, "is_non_linear_format_io": false}],
    "batch_input": [], "batch_output": [],
    "dynamic_batching": {"preferred_batch_size": [128], "max_queue_delay_microseconds": 1000,
                         "preserve_ordering": false, "priority_levels": 0,
                         "default_priority_level": 0, "priority_queue_policy": {}},
    "instance_group": [{"name": "gpu_sim_0", "kind": "KIND_CPU", "count": 4, "gpus": [],
                        "secondary_devices": [], "profile": [], "passive": false,
                        "host_policy": ""}],
    "default_model_filename": "model.py", "cc_model_filenames": {}, "metric_tags": {},
    "parameters": {"step_time_base_ms": {"string_value": "4.0"}}, "model_warmup": []}"""
)


def settings(**profile: Any) -> rendering.Settings:
    return rendering.render(
        specs.Profile.model_validate({"maxQueueDelayMicroseconds": 2000, **profile})
    )


def served_after(target: overrides.Override) -> dict[str, Any]:
    """What Triton reports once it loaded `target`: what was sent, round-tripped."""
    return json.loads(json.dumps(target.config))


def test_target_changes_only_batching_max_batch_and_our_parameters() -> None:
    wanted = overrides.merge(
        SERVED, settings(preferredBatchSizes=[4, 8]), profile="interactive", model="gpu_sim"
    )
    changed = {key for key in SERVED if wanted.config[key] != SERVED[key]}
    assert changed == {"dynamic_batching", "parameters"}
    assert wanted.config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert wanted.config["parameters"]["step_time_base_ms"] == {"string_value": "4.0"}
    assert modelconfigs.applied_profile(wanted.config) == "interactive"
    assert modelconfigs.baseline_max_batch_size(wanted.config) == 128


def test_unchanged_profile_matches_what_the_server_reports() -> None:
    wanted = overrides.merge(
        SERVED, settings(preferredBatchSizes=[8, 4]), profile="interactive", model="gpu_sim"
    )
    served = served_after(wanted)
    # Triton leaves out fields at their defaults; that is no difference.
    del served["dynamic_batching"]["default_queue_policy"]
    assert overrides.matches(served, wanted)
    assert not overrides.matches(SERVED, wanted)


def test_empty_preferred_sizes_are_written_as_triton_fills_them() -> None:
    wanted = overrides.merge(SERVED, settings(maxBatchSize=32), profile="small", model="gpu_sim")
    assert wanted.config["max_batch_size"] == 32
    assert wanted.config["dynamic_batching"]["preferred_batch_size"] == [32]


def test_lowered_max_batch_size_is_restored_by_a_profile_without_one() -> None:
    capped = served_after(
        overrides.merge(SERVED, settings(maxBatchSize=16), profile="a", model="m")
    )
    assert capped["max_batch_size"] == 16
    uncapped = overrides.merge(capped, settings(), profile="b", model="m")
    assert uncapped.config["max_batch_size"] == 128


def test_profile_change_alone_is_a_difference() -> None:
    applied = served_after(overrides.merge(SERVED, settings(), profile="a", model="m"))
    assert not overrides.matches(
        applied, overrides.merge(applied, settings(), profile="b", model="m")
    )


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (
            {"maxBatchSize": 256},
            "maxBatchSize 256 is above model 'gpu_sim''s own max_batch_size 128",
        ),
        (
            {"preferredBatchSizes": [64, 256]},
            "preferred batch sizes [256] exceed model 'gpu_sim''s max_batch_size 128",
        ),
    ],
)
def test_profile_the_model_cannot_take_is_refused(profile: dict[str, Any], message: str) -> None:
    with pytest.raises(
        overrides.ProfileRefused, match=message.replace("[", r"\[").replace("]", r"\]")
    ):
        overrides.merge(SERVED, settings(**profile), profile="x", model="gpu_sim")


def test_baseline_survives_a_lowered_max_batch_size() -> None:
    capped = served_after(
        overrides.merge(SERVED, settings(maxBatchSize=16), profile="a", model="m")
    )
    # 64 is above the served 16 but within the model's own 128.
    overrides.check(capped, settings(maxBatchSize=64), model="m")
    with pytest.raises(overrides.ProfileRefused):
        overrides.check(capped, settings(maxBatchSize=129), model="m")


def test_model_without_batching_is_refused() -> None:
    unbatched = copy.deepcopy(SERVED)
    unbatched["max_batch_size"] = 0
    with pytest.raises(overrides.ProfileRefused, match="does not batch"):
        overrides.check(unbatched, settings(), model="m")


@pytest.mark.parametrize("stored", ["abc", "", "-3", "1e3", "١٢٨"])
def test_a_malformed_baseline_is_ignored_reported_and_written_afresh(stored: str) -> None:
    capped = served_after(
        overrides.merge(SERVED, settings(maxBatchSize=16), profile="a", model="m")
    )
    capped["parameters"][modelconfigs.BASELINE_PARAMETER] = {"string_value": stored}
    assert modelconfigs.malformed_parameters(capped) == [
        f"{modelconfigs.BASELINE_PARAMETER} ({stored!r} is not a count)"
    ]
    # The served max_batch_size stands in: the most the model is known to take.
    wanted = overrides.merge(capped, settings(), profile="a", model="m")
    assert wanted.config["max_batch_size"] == 16
    assert modelconfigs.parameter(wanted.config, modelconfigs.BASELINE_PARAMETER) == "16"
    assert not overrides.matches(capped, wanted)  # one reload writes it afresh
    assert overrides.matches(served_after(wanted), wanted)
    with pytest.raises(overrides.ProfileRefused, match=r"above model 'm'.s own max_batch_size 16"):
        overrides.check(capped, settings(maxBatchSize=64), model="m")
