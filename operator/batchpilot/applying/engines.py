"""The load request a profile becomes for a model served by an LLM engine (Triton's vLLM and
TensorRT-LLM backends).

vLLM batches continuously inside the engine, so its batching knobs are engine arguments, kept in
the `model.json` file of the model's version directory, not in the model configuration. A
profile is applied by a load that overrides that file (`file:<version>/model.json`) together
with the configuration. Triton then loads the model from a fresh directory that holds only the
files of the request, so the file sent is complete: the repository's `model.json` with the
profile's arguments on top.

The served configuration does not show `model.json`, so batchpilot also writes the arguments it
set into a config parameter (`batchpilot.dev/engine-arguments`): that is what verification reads
back, and what a rollback rebuilds the previous file from.

The repository's `model.json` comes from an `EngineArgumentsSource`: the standalone runner reads
the repository directory it is given; in a cluster only the Pod sees its repository, so the
sidecar beside Triton mounts it and serves the file (`batchpilot.applying.pod_repositories`).

Triton's TensorRT-LLM backend (`backend: "tensorrtllm"`) reads its batching knobs from config
parameters instead, so a profile is applied by a config-only load, as `dynamic_batching` is: the
served configuration with the profile's parameters on top. Its parameters show in the served
configuration, so verification reads them back and a rollback loads the previous configuration
again. Like a profile's max_batch_size, the parameters start from the repository's values, kept
in `batchpilot.dev/baseline-parameters`, so a field one profile leaves out takes the repository's
value, not the previous profile's. The backend fixes some knobs when the engine is built
(max_batch_size, max_num_tokens); a profile that sets them is refused.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from batchpilot.applying.overrides import Override, ProfileRefused
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs, repositories
from batchpilot_triton.modelconfigs import ModelConfig

# Named here by the apply path; they live below both programs, where the sidecar reads them too.
ENGINE_ARGUMENTS_FILE = repositories.ENGINE_ARGUMENTS_FILE
RepositoryArguments = repositories.RepositoryArguments
is_llm_engine = modelconfigs.served_by_vllm
applied_arguments = modelconfigs.applied_engine_arguments
TENSORRT_LLM_BACKEND = "tensorrtllm"

Rendered = TypeVar("Rendered")


@dataclass(frozen=True)
class _Backend:
    """An LLM backend as a profile's refusals name it."""

    name: str
    fields: frozenset[str]
    """The `llm` fields it takes."""
    lacking: Mapping[str, str]
    """Why it takes no setting for each of the other fields."""


_VLLM = _Backend(
    "vLLM",
    rendering.VLLM_FIELDS,
    {
        "batchSchedulerPolicy": "a TensorRT-LLM setting; vLLM has no engine argument for it",
        "maxTokensInPagedKvCache": "a TensorRT-LLM setting; vLLM sizes its KV cache by "
        "gpu_memory_utilization",
    },
)
_TENSORRT_LLM = _Backend(
    "TensorRT-LLM",
    rendering.TENSORRT_LLM_FIELDS,
    {
        "maxNumSeqs": "the engine's max_batch_size, fixed by trtllm-build, caps the sequences "
        "it runs; the backend dropped its max_num_sequences parameter in January 2024",
        "maxNumBatchedTokens": "the engine's max_num_tokens is fixed by trtllm-build",
    },
)
# gpt_model_type values of static batching, whose engine neither schedules nor chunks in flight.
_STATIC_BATCHING = ("V1", "v1")


def is_tensorrt_llm(config: Mapping[str, Any]) -> bool:
    """Whether Triton serves the model with its TensorRT-LLM backend (config parameters)."""
    return config.get("backend") == TENSORRT_LLM_BACKEND


class EngineArgumentsSource(Protocol):
    """Where the repository's `model.json` of a model a replica serves is read from."""

    async def repository_arguments(self, replica: Replica, model: str) -> RepositoryArguments: ...


class EngineArgumentsUnavailable(ProfileRefused):
    """The repository's `model.json` could not be read; nothing was applied."""


@dataclass(frozen=True)
class ModelRepository:
    """A model repository on a file system this process can read, the one every replica loads
    from (the standalone runner's)."""

    path: Path

    async def repository_arguments(self, replica: Replica, model: str) -> RepositoryArguments:
        try:
            return repositories.read_repository_arguments(self.path, model)
        except repositories.RepositoryError as error:
            raise EngineArgumentsUnavailable(str(error)) from None


def check(base: RepositoryArguments, settings: rendering.Settings, *, model: str) -> dict[str, Any]:
    """The profile's engine arguments; refuses, before anything is applied, settings the model
    cannot take."""
    engine_arguments = _taken(_VLLM, settings, settings.engine_arguments, model=model)
    arguments = {**base.arguments, **engine_arguments}
    if "model" not in arguments:
        raise ProfileRefused(f"model {model!r}: its {ENGINE_ARGUMENTS_FILE} names no model")
    if arguments.get("enable_chunked_prefill") is not False:
        return engine_arguments
    tokens = _token_count(arguments, "max_num_batched_tokens", model=model)
    max_model_len = _token_count(arguments, "max_model_len", model=model)
    if tokens is not None and max_model_len is not None and tokens < max_model_len:
        raise ProfileRefused(
            f"maxNumBatchedTokens {tokens} is below model {model!r}'s max_model_len "
            f"{max_model_len}: without chunked prefill a prompt that long could never be "
            "scheduled"
        )
    return engine_arguments


def _token_count(arguments: Mapping[str, Any], key: str, *, model: str) -> int | None:
    """An engine argument that counts tokens, as a number; refuses one that is not a count."""
    value = arguments.get(key)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ProfileRefused(
        f"model {model!r}: its {ENGINE_ARGUMENTS_FILE} sets {key} to {str(value)[:40]!r}, not a "
        "whole number of tokens, so batchpilot cannot check the profile against it; write it as "
        "a number"
    )


def merge(
    config: ModelConfig,
    base: RepositoryArguments,
    settings: rendering.Settings,
    *,
    profile: str,
    model: str,
) -> Override:
    """The load request that makes the model run the profile; raises ProfileRefused."""
    wanted = check(base, settings, model=model)
    return _override(config, base, wanted, profile=profile)


def restoring(config: ModelConfig, base: RepositoryArguments) -> Override:
    """The load request that serves `config` again, with the `model.json` it was served with."""
    written = applied_arguments(config)
    profile = modelconfigs.applied_profile(config) or ""
    if written is None:
        # The repository's own files: a load without file overrides reads them again.
        return Override(copy.deepcopy(config), profile)
    return _override(config, base, written, profile=profile)


def _override(
    config: ModelConfig,
    base: RepositoryArguments,
    engine_arguments: Mapping[str, Any],
    *,
    profile: str,
) -> Override:
    merged = copy.deepcopy(config)
    parameters = dict(merged.get("parameters") or {})
    parameters[modelconfigs.PROFILE_PARAMETER] = {"string_value": profile}
    parameters[modelconfigs.ENGINE_ARGUMENTS_PARAMETER] = {
        "string_value": _canonical(engine_arguments)
    }
    merged["parameters"] = parameters
    model_json = json.dumps({**base.arguments, **engine_arguments}, indent=2, sort_keys=True)
    return Override(
        config=merged,
        profile=profile,
        files={f"file:{base.version}/{ENGINE_ARGUMENTS_FILE}": model_json.encode()},
    )


def _canonical(arguments: Mapping[str, Any]) -> str:
    return json.dumps(dict(arguments), sort_keys=True, separators=(",", ":"))


def matches(served: ModelConfig, wanted: Override) -> bool:
    """Whether the server already runs the wanted profile and engine arguments (a rollback to
    the repository's own files wants no profile at all)."""
    return modelconfigs.applied_profile(served) == modelconfigs.applied_profile(
        wanted.config
    ) and applied_arguments(served) == applied_arguments(wanted.config)


def runs(served: ModelConfig, settings: rendering.Settings, *, profile: str, model: str) -> bool:
    """Whether the server already runs the profile's engine settings (no repository read)."""
    _taken(_VLLM, settings, settings.engine_arguments, model=model)
    return modelconfigs.applied_profile(served) == profile and applied_arguments(served) == (
        settings.engine_arguments
    )


def _taken(
    backend: _Backend, settings: rendering.Settings, rendered: Rendered | None, *, model: str
) -> Rendered:
    """The profile's llm section as `backend` takes it (`rendered`); refuses a profile without
    one, or with fields the backend has no setting for."""
    if rendered is None:
        raise ProfileRefused(
            f"model {model!r} is served by Triton's {backend.name} backend, which batches inside "
            f"the engine: the profile needs an llm section ({', '.join(sorted(backend.fields))}) "
            "to set it"
        )
    unsupported = sorted(settings.llm_fields - backend.fields)
    if unsupported:
        raise ProfileRefused(
            f"model {model!r} is served by Triton's {backend.name} backend, which has no setting "
            "for " + "; ".join(f"{field} ({backend.lacking[field]})" for field in unsupported)
        )
    return rendered


def check_parameters(
    config: ModelConfig, settings: rendering.Settings, *, model: str
) -> dict[str, str]:
    """The profile's TensorRT-LLM config parameters; refuses, before anything is applied,
    settings the model cannot take."""
    wanted = _taken(_TENSORRT_LLM, settings, settings.tensorrt_llm_parameters, model=model)
    batching = modelconfigs.parameter(config, "gpt_model_type")
    in_flight_only = sorted(
        field
        for field, on in (
            ("batchSchedulerPolicy", "batch_scheduler_policy" in wanted),
            ("chunkedPrefill", wanted.get("enable_chunked_context") == "true"),
        )
        if on
    )
    if batching in _STATIC_BATCHING and in_flight_only:
        raise ProfileRefused(
            f"model {model!r} batches statically (gpt_model_type {batching}): "
            f"{', '.join(in_flight_only)} apply to in-flight batching only"
        )
    return wanted


def baseline_parameters(config: Mapping[str, Any]) -> dict[str, str | None]:
    """The repository's values of the config parameters batchpilot set on this served
    configuration (None: the repository has no such parameter)."""
    stored = modelconfigs.json_parameter(config, modelconfigs.BASELINE_PARAMETERS_PARAMETER)
    # Malformed (`modelconfigs.malformed_parameters`): the repository's values are unknown, and
    # the served ones stand in for them.
    return {
        key: value
        for key, value in (stored or {}).items()
        if value is None or isinstance(value, str)
    }


def merge_parameters(
    config: ModelConfig, settings: rendering.Settings, *, profile: str, model: str
) -> Override:
    """The served configuration with the profile's TensorRT-LLM parameters, over the
    repository's; raises ProfileRefused."""
    wanted = check_parameters(config, settings, model=model)
    baseline = baseline_parameters(config)
    merged = copy.deepcopy(config)
    parameters = dict(merged.get("parameters") or {})
    for key, value in baseline.items():
        if value is None:
            parameters.pop(key, None)
        else:
            parameters[key] = {"string_value": value}
    for key, value in wanted.items():
        baseline.setdefault(key, modelconfigs.parameter({"parameters": parameters}, key))
        parameters[key] = {"string_value": value}
    parameters[modelconfigs.PROFILE_PARAMETER] = {"string_value": profile}
    parameters[modelconfigs.ENGINE_ARGUMENTS_PARAMETER] = {"string_value": _canonical(wanted)}
    parameters[modelconfigs.BASELINE_PARAMETERS_PARAMETER] = {"string_value": _canonical(baseline)}
    merged["parameters"] = parameters
    return Override(config=merged, profile=profile)


def parameters_match(served: ModelConfig, wanted: Override) -> bool:
    """Whether the server already runs the wanted TensorRT-LLM parameters (and profile)."""
    return (served.get("parameters") or {}) == (wanted.config.get("parameters") or {})
