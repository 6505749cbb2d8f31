"""The load request a profile becomes for a model served by an LLM engine (Triton's vLLM backend).

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
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from batchpilot.applying.overrides import Override, ProfileRefused
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs, repositories
from batchpilot_triton.modelconfigs import ModelConfig

VLLM_BACKEND = "vllm"
# Named here by the apply path; they live below both programs, where the sidecar reads them too.
ENGINE_ARGUMENTS_FILE = repositories.ENGINE_ARGUMENTS_FILE
RepositoryArguments = repositories.RepositoryArguments


def is_llm_engine(config: Mapping[str, Any]) -> bool:
    """Whether Triton serves the model with an LLM engine whose arguments batchpilot sets."""
    return config.get("backend") == VLLM_BACKEND


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


def applied_arguments(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine arguments batchpilot set on this served configuration, if it set any."""
    written = modelconfigs.parameter(config, modelconfigs.ENGINE_ARGUMENTS_PARAMETER)
    return None if written is None else dict(json.loads(written))


def check(base: RepositoryArguments, settings: rendering.Settings, *, model: str) -> dict[str, Any]:
    """The profile's engine arguments; refuses, before anything is applied, settings the model
    cannot take."""
    if settings.engine_arguments is None:
        raise ProfileRefused(
            f"model {model!r} is served by Triton's vLLM backend, which batches inside the "
            "engine: the profile needs an llm section (maxNumSeqs, maxNumBatchedTokens, "
            "chunkedPrefill) to set it"
        )
    arguments = {**base.arguments, **settings.engine_arguments}
    if "model" not in arguments:
        raise ProfileRefused(f"model {model!r}: its {ENGINE_ARGUMENTS_FILE} names no model")
    tokens = arguments.get("max_num_batched_tokens")
    max_model_len = arguments.get("max_model_len")
    if (
        tokens is not None
        and max_model_len is not None
        and arguments.get("enable_chunked_prefill") is False
        and int(tokens) < int(max_model_len)
    ):
        raise ProfileRefused(
            f"maxNumBatchedTokens {tokens} is below model {model!r}'s max_model_len "
            f"{max_model_len}: without chunked prefill a prompt that long could never be "
            "scheduled"
        )
    return settings.engine_arguments


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
    """Whether the server already runs the wanted profile and engine arguments."""
    return modelconfigs.applied_profile(served) == wanted.profile and applied_arguments(
        served
    ) == applied_arguments(wanted.config)


def runs(served: ModelConfig, settings: rendering.Settings, *, profile: str, model: str) -> bool:
    """Whether the server already runs the profile's engine settings (no repository read)."""
    if settings.engine_arguments is None:
        check(RepositoryArguments("", {}), settings, model=model)
    return modelconfigs.applied_profile(served) == profile and applied_arguments(served) == (
        settings.engine_arguments
    )
