"""LLM profiles as Triton load requests for the vLLM backend: a complete model.json, the
arguments written into the config, refusals, and the request that restores the previous one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import engines, overrides, replicas
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs

# What tritonserver 2.51 reported for manifests/llm-repository/tiny_llm (GET .../config), cut.
SERVED: dict[str, Any] = {
    "name": "tiny_llm",
    "backend": "vllm",
    "max_batch_size": 0,
    "model_transaction_policy": {"decoupled": True},
    "parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "true"}},
}
BASE = engines.RepositoryArguments(
    version="1",
    arguments={
        "model": "/models/tiny-llama",
        "max_model_len": 512,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 2048,
    },
)


def settings(**llm: Any) -> rendering.Settings:
    return rendering.render(specs.Profile.model_validate({"llm": llm}))


def model_json(override: overrides.Override) -> dict[str, Any]:
    (content,) = override.files.values()
    loaded: dict[str, Any] = json.loads(content)
    return loaded


def test_the_profile_is_sent_as_a_complete_model_json_and_written_into_the_config() -> None:
    wanted = engines.merge(
        SERVED, BASE, settings(maxNumSeqs=4, chunkedPrefill=True), profile="interactive", model="m"
    )
    assert list(wanted.files) == ["file:1/model.json"]
    assert model_json(wanted) == {
        "model": "/models/tiny-llama",
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,
        "enable_chunked_prefill": True,
    }
    assert modelconfigs.applied_profile(wanted.config) == "interactive"
    assert engines.applied_arguments(wanted.config) == {
        "max_num_seqs": 4,
        "enable_chunked_prefill": True,
    }
    # The rest of the served configuration is passed through, and the served one is untouched.
    assert wanted.config["parameters"]["REPORT_CUSTOM_METRICS"] == {"string_value": "true"}
    assert modelconfigs.applied_profile(SERVED) is None


def test_the_server_runs_the_profile_once_its_config_says_so() -> None:
    wanted = engines.merge(SERVED, BASE, settings(maxNumSeqs=4), profile="interactive", model="m")
    served_after = json.loads(json.dumps(wanted.config))
    assert engines.matches(served_after, wanted)
    assert engines.runs(served_after, settings(maxNumSeqs=4), profile="interactive", model="m")
    assert not engines.runs(served_after, settings(maxNumSeqs=8), profile="interactive", model="m")
    assert not engines.runs(served_after, settings(maxNumSeqs=4), profile="bulk", model="m")
    assert not engines.matches(SERVED, wanted)


def test_a_profile_without_llm_settings_is_refused_for_an_llm_model() -> None:
    batching = rendering.render(specs.Profile.model_validate({"maxQueueDelayMicroseconds": 100}))
    with pytest.raises(overrides.ProfileRefused, match="needs an llm section"):
        engines.merge(SERVED, BASE, batching, profile="interactive", model="m")
    with pytest.raises(overrides.ProfileRefused, match="needs an llm section"):
        engines.runs(SERVED, batching, profile="interactive", model="m")


def test_a_step_budget_below_max_model_len_is_refused_without_chunked_prefill() -> None:
    with pytest.raises(overrides.ProfileRefused, match=r"256 is below model 'm'.s max_model_len"):
        engines.merge(
            SERVED,
            BASE,
            settings(maxNumBatchedTokens=256, chunkedPrefill=False),
            profile="bulk",
            model="m",
        )
    # With chunked prefill a long prompt is split, so the same budget is fine.
    engines.merge(
        SERVED, BASE, settings(maxNumBatchedTokens=256, chunkedPrefill=True), profile="p", model="m"
    )


def test_restoring_a_profile_rebuilds_its_model_json_and_the_repository_needs_no_files() -> None:
    applied = engines.merge(SERVED, BASE, settings(maxNumSeqs=2), profile="interactive", model="m")
    restore = engines.restoring(applied.config, BASE)
    assert model_json(restore) == model_json(applied)
    assert restore.profile == "interactive"
    from_repository = engines.restoring(SERVED, BASE)
    assert from_repository.files == {}
    assert from_repository.config == SERVED


def test_only_the_vllm_backend_is_an_llm_engine() -> None:
    assert engines.is_llm_engine(SERVED)
    assert not engines.is_llm_engine({"backend": "python", "max_batch_size": 8})


async def test_a_repository_that_cannot_give_the_model_json_refuses_the_profile(
    tmp_path: Path,
) -> None:
    (tmp_path / "llm" / "1").mkdir(parents=True)
    repository = engines.ModelRepository(tmp_path)
    with pytest.raises(engines.EngineArgumentsUnavailable, match=r"no model\.json in a version"):
        await repository.repository_arguments(replicas.from_url("http://127.0.0.1:8000"), "llm")


@pytest.mark.parametrize("written", ["8k", 8192.5, True, [8192]])
def test_a_max_model_len_that_is_not_a_count_refuses_the_profile_saying_so(written: Any) -> None:
    base = engines.RepositoryArguments("1", {**BASE.arguments, "max_model_len": written})
    no_chunking = settings(maxNumBatchedTokens=4096, chunkedPrefill=False)
    with pytest.raises(overrides.ProfileRefused, match=r"max_model_len .* not a whole number"):
        engines.merge(SERVED, base, no_chunking, profile="bulk", model="m")
    # A count written as a string is a count.
    counted = engines.RepositoryArguments("1", {**BASE.arguments, "max_model_len": "8192"})
    with pytest.raises(overrides.ProfileRefused, match=r"4096 is below model 'm'.s max_model_len"):
        engines.merge(SERVED, counted, no_chunking, profile="bulk", model="m")


def test_malformed_engine_arguments_on_the_served_config_are_unknown_and_written_afresh() -> None:
    served = json.loads(json.dumps(SERVED))
    served["parameters"][modelconfigs.ENGINE_ARGUMENTS_PARAMETER] = {"string_value": "{not json"}
    served["parameters"][modelconfigs.PROFILE_PARAMETER] = {"string_value": "interactive"}
    assert modelconfigs.malformed_parameters(served) == [
        "batchpilot.dev/engine-arguments ('{not json' is not a JSON object)"
    ]
    assert not engines.runs(served, settings(maxNumSeqs=4), profile="interactive", model="m")
    wanted = engines.merge(served, BASE, settings(maxNumSeqs=4), profile="interactive", model="m")
    assert engines.applied_arguments(wanted.config) == {"max_num_seqs": 4}
    # A rollback to it loads the repository's own model.json.
    assert engines.restoring(served, BASE).files == {}


def test_a_rollback_to_the_repository_s_own_files_is_verified_once_it_serves() -> None:
    # Before, it wanted the profile "" where the served configuration names none, so every such
    # rollback of a vLLM model read as failed and left its Pod out of its Services.
    restore = engines.restoring(SERVED, BASE)
    assert restore.files == {}
    assert engines.matches(json.loads(json.dumps(SERVED)), restore)
    applied = engines.merge(SERVED, BASE, settings(maxNumSeqs=4), profile="bulk", model="m")
    assert not engines.matches(json.loads(json.dumps(applied.config)), restore)
