"""LLM profiles as config parameters of Triton's TensorRT-LLM backend: their rendering as the
backend parses them, the config-only load request built on the repository's values, and the
settings the backend cannot take, refused before anything is loaded."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import engines, overrides
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs

# The tensorrt_llm model of tensorrtllm_backend's all_models/inflight_batcher_llm as Triton
# serves it once fill_template.py has run, cut to what matters here.
SERVED: dict[str, Any] = {
    "name": "tensorrt_llm",
    "platform": "",
    "backend": "tensorrtllm",
    "max_batch_size": 64,
    "model_transaction_policy": {"decoupled": True},
    "dynamic_batching": {"preferred_batch_size": [64], "max_queue_delay_microseconds": 0},
    "parameters": {
        "gpt_model_type": {"string_value": "inflight_fused_batching"},
        "gpt_model_path": {"string_value": "/engines/llama/1-gpu"},
        "batch_scheduler_policy": {"string_value": "guaranteed_no_evict"},
        "kv_cache_free_gpu_mem_fraction": {"string_value": "0.9"},
    },
}


def settings(**llm: Any) -> rendering.Settings:
    return rendering.render(specs.Profile.model_validate({"llm": llm}))


def parameters(config: dict[str, Any]) -> dict[str, str]:
    return {key: value["string_value"] for key, value in config["parameters"].items()}


@pytest.mark.parametrize(
    ("llm", "rendered"),
    [
        ({"chunkedPrefill": True}, {"enable_chunked_context": "true"}),
        ({"chunkedPrefill": False}, {"enable_chunked_context": "false"}),
        ({"batchSchedulerPolicy": "maxUtilization"}, {"batch_scheduler_policy": "max_utilization"}),
        (
            {"batchSchedulerPolicy": "guaranteedNoEvict"},
            {"batch_scheduler_policy": "guaranteed_no_evict"},
        ),
        ({"maxTokensInPagedKvCache": 65536}, {"max_tokens_in_paged_kv_cache": "65536"}),
        ({}, {}),
    ],
)
def test_llm_fields_render_as_the_strings_the_backend_parses(
    llm: dict[str, Any], rendered: dict[str, str]
) -> None:
    assert settings(**llm).tensorrt_llm_parameters == rendered


def test_a_profile_without_an_llm_section_renders_no_parameters() -> None:
    batching = rendering.render(specs.Profile.model_validate({"maxQueueDelayMicroseconds": 100}))
    assert batching.tensorrt_llm_parameters is None
    assert batching.llm_fields == frozenset()


def test_the_profile_s_parameters_go_over_the_served_config_which_passes_through() -> None:
    wanted = engines.merge_parameters(
        SERVED,
        settings(batchSchedulerPolicy="maxUtilization", chunkedPrefill=True),
        profile="bulk",
        model="tensorrt_llm",
    )
    assert wanted.files == {}  # a config-only load: the engine is the repository's
    assert parameters(wanted.config) == {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": "/engines/llama/1-gpu",
        "batch_scheduler_policy": "max_utilization",
        "kv_cache_free_gpu_mem_fraction": "0.9",
        "enable_chunked_context": "true",
        "batchpilot.dev/profile": "bulk",
        "batchpilot.dev/engine-arguments": (
            '{"batch_scheduler_policy":"max_utilization","enable_chunked_context":"true"}'
        ),
        "batchpilot.dev/baseline-parameters": (
            '{"batch_scheduler_policy":"guaranteed_no_evict","enable_chunked_context":null}'
        ),
    }
    assert {key: value for key, value in wanted.config.items() if key != "parameters"} == {
        key: value for key, value in SERVED.items() if key != "parameters"
    }
    assert engines.applied_arguments(wanted.config) == {
        "batch_scheduler_policy": "max_utilization",
        "enable_chunked_context": "true",
    }
    assert modelconfigs.parameter(SERVED, modelconfigs.PROFILE_PARAMETER) is None  # untouched


def test_a_field_the_next_profile_leaves_out_takes_the_repository_s_value_again() -> None:
    bulk = engines.merge_parameters(
        SERVED,
        settings(batchSchedulerPolicy="maxUtilization", chunkedPrefill=True),
        profile="bulk",
        model="m",
    )
    served_bulk = json.loads(json.dumps(bulk.config))
    interactive = engines.merge_parameters(
        served_bulk, settings(maxTokensInPagedKvCache=8192), profile="interactive", model="m"
    )
    got = parameters(interactive.config)
    assert got["batch_scheduler_policy"] == "guaranteed_no_evict"  # the repository's
    assert "enable_chunked_context" not in got  # the repository has none: the backend default
    assert got["max_tokens_in_paged_kv_cache"] == "8192"
    assert json.loads(got["batchpilot.dev/baseline-parameters"]) == {
        "batch_scheduler_policy": "guaranteed_no_evict",
        "enable_chunked_context": None,
        "max_tokens_in_paged_kv_cache": None,
    }
    # Back to bulk from there: the same request as from the repository's config.
    again = engines.merge_parameters(
        json.loads(json.dumps(interactive.config)),
        settings(batchSchedulerPolicy="maxUtilization", chunkedPrefill=True),
        profile="bulk",
        model="m",
    )
    assert parameters(again.config) == {
        **parameters(bulk.config),
        "batchpilot.dev/baseline-parameters": got["batchpilot.dev/baseline-parameters"],
    }


def test_the_server_runs_the_profile_once_its_parameters_say_so() -> None:
    bulk = settings(batchSchedulerPolicy="maxUtilization")
    wanted = engines.merge_parameters(SERVED, bulk, profile="bulk", model="m")
    served_after = json.loads(json.dumps(wanted.config))
    assert engines.parameters_match(served_after, wanted)
    assert not engines.parameters_match(SERVED, wanted)
    # Merging the same profile over what it produced changes nothing: no reload is needed.
    assert engines.parameters_match(
        served_after, engines.merge_parameters(served_after, bulk, profile="bulk", model="m")
    )
    other = engines.merge_parameters(served_after, bulk, profile="interactive", model="m")
    assert not engines.parameters_match(served_after, other)


def test_only_the_tensorrtllm_backend_takes_parameters() -> None:
    assert engines.is_tensorrt_llm(SERVED)
    assert not engines.is_llm_engine(SERVED)
    assert not engines.is_tensorrt_llm({"backend": "vllm"})
    assert not engines.is_tensorrt_llm({"backend": "python", "max_batch_size": 8})


def test_a_profile_without_an_llm_section_is_refused() -> None:
    batching = rendering.render(specs.Profile.model_validate({"maxQueueDelayMicroseconds": 100}))
    with pytest.raises(overrides.ProfileRefused, match=r"TensorRT-LLM backend.*needs an llm"):
        engines.merge_parameters(SERVED, batching, profile="p", model="m")


@pytest.mark.parametrize(
    ("llm", "message"),
    [
        ({"maxNumSeqs": 8}, r"no setting for maxNumSeqs \(the engine's max_batch_size, fixed by"),
        ({"maxNumBatchedTokens": 512}, r"maxNumBatchedTokens \(the engine's max_num_tokens"),
        (
            {"maxNumSeqs": 8, "maxNumBatchedTokens": 512, "chunkedPrefill": True},
            r"no setting for maxNumBatchedTokens \(.*\); maxNumSeqs \(",
        ),
    ],
)
def test_knobs_fixed_when_the_engine_is_built_are_refused(
    llm: dict[str, Any], message: str
) -> None:
    with pytest.raises(overrides.ProfileRefused, match=message):
        engines.merge_parameters(SERVED, settings(**llm), profile="p", model="m")


def test_in_flight_settings_are_refused_for_a_statically_batching_model() -> None:
    static = copy.deepcopy(SERVED)
    static["parameters"]["gpt_model_type"] = {"string_value": "V1"}
    with pytest.raises(
        overrides.ProfileRefused,
        match=r"batches statically \(gpt_model_type V1\): batchSchedulerPolicy, chunkedPrefill",
    ):
        engines.merge_parameters(
            static,
            settings(batchSchedulerPolicy="maxUtilization", chunkedPrefill=True),
            profile="p",
            model="m",
        )
    # Turning chunking off, or capping the KV cache, is something a static engine can take.
    engines.merge_parameters(
        static, settings(chunkedPrefill=False, maxTokensInPagedKvCache=4096), profile="p", model="m"
    )


def test_the_vllm_backend_refuses_tensorrt_llm_settings() -> None:
    vllm = {"name": "tiny_llm", "backend": "vllm", "max_batch_size": 0}
    base = engines.RepositoryArguments("1", {"model": "/models/tiny"})
    trt_only = settings(chunkedPrefill=True, maxTokensInPagedKvCache=4096)
    with pytest.raises(overrides.ProfileRefused, match=r"vLLM backend.*maxTokensInPagedKvCache"):
        engines.merge(vllm, base, trt_only, profile="p", model="m")
    with pytest.raises(overrides.ProfileRefused, match=r"no setting for batchSchedulerPolicy"):
        engines.runs(vllm, settings(batchSchedulerPolicy="maxUtilization"), profile="p", model="m")


def test_a_profile_mixing_vllm_only_and_tensorrt_llm_only_fields_is_invalid() -> None:
    with pytest.raises(ValueError, match="no model's backend could take the profile"):
        specs.LlmEngine.model_validate({"maxNumSeqs": 8, "batchSchedulerPolicy": "maxUtilization"})
    # chunkedPrefill is common to both, so it combines with either side.
    specs.LlmEngine.model_validate({"maxNumSeqs": 8, "chunkedPrefill": True})
    specs.LlmEngine.model_validate({"maxTokensInPagedKvCache": 1, "chunkedPrefill": True})
