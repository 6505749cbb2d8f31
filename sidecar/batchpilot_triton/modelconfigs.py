"""What batchpilot reads in a model configuration as Triton serves it.

Configurations are Triton's JSON form (`GET v2/models/{name}/config`), kept as plain dicts: they
are Triton's documents, not ours, and carry many fields batchpilot passes through untouched.
batchpilot keeps its own facts about a model in config parameters, named here once:

- `batchpilot.dev/profile`: the profile batchpilot last applied, so anyone reading the served
  config (and the operator after a restart) can tell which profile a server runs;
- `batchpilot.dev/baseline-max-batch-size`: the model's own `max_batch_size` from its
  repository, which a profile may lower but never raise. A restarted server forgets both, which
  is exactly right: its config is the repository's again;
- `batchpilot.dev/engine-arguments`: for a model served by an LLM engine, the engine settings
  (JSON) batchpilot set: for vLLM the arguments it wrote into `model.json`, which the served
  config does not otherwise show; for TensorRT-LLM the config parameters it set;
- `batchpilot.dev/baseline-parameters`: for TensorRT-LLM, the repository's own values (JSON,
  null where the repository has none) of the config parameters batchpilot set, which the next
  profile starts from, as a profile's max_batch_size starts from the baseline above;
- `batchpilot.dev/memory-per-item-bytes`: declared by the model's author, the device memory one
  more batch item takes, for the sidecar's memory cap on the preferred batch size.

Triton's vLLM backend takes its engine arguments from the repository's `model.json`, which the
served configuration does not show: the engine runs that file with batchpilot's arguments on
top, when batchpilot applied any. The operator lays a profile over it; the sidecar reads from it
the most sequences the engine runs at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROFILE_PARAMETER = "batchpilot.dev/profile"
BASELINE_PARAMETER = "batchpilot.dev/baseline-max-batch-size"
ENGINE_ARGUMENTS_PARAMETER = "batchpilot.dev/engine-arguments"
BASELINE_PARAMETERS_PARAMETER = "batchpilot.dev/baseline-parameters"
MEMORY_PER_ITEM_PARAMETER = "batchpilot.dev/memory-per-item-bytes"
VLLM_BACKEND = "vllm"

ModelConfig = dict[str, Any]


def parameter(config: Mapping[str, Any], key: str) -> str | None:
    """A config parameter's string value, if the config has it."""
    parameters = config.get("parameters")
    value = parameters.get(key) if isinstance(parameters, Mapping) else None
    text = value.get("string_value") if isinstance(value, Mapping) else None
    return text if isinstance(text, str) else None


def json_parameter(config: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """A config parameter that holds a JSON object; None when it is absent or holds anything
    else (batchpilot never writes that, so the object it wrote is unknown)."""
    text = parameter(config, key)
    try:
        value = None if text is None else json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.isascii() and text.isdigit() else None


def malformed_parameters(config: Mapping[str, Any]) -> list[str]:
    """batchpilot's parameters on this served configuration that hold what batchpilot never
    writes (someone edited them, or another tool wrote them): each is ignored, and the next load
    writes it afresh."""
    found = []
    stored = parameter(config, BASELINE_PARAMETER)
    if stored is not None and _count(stored) is None:
        found.append(f"{BASELINE_PARAMETER} ({stored[:40]!r} is not a count)")
    for key in (ENGINE_ARGUMENTS_PARAMETER, BASELINE_PARAMETERS_PARAMETER):
        stored = parameter(config, key)
        if stored is not None and json_parameter(config, key) is None:
            found.append(f"{key} ({stored[:40]!r} is not a JSON object)")
    return found


def applied_profile(config: Mapping[str, Any]) -> str | None:
    """The profile batchpilot last applied to this served configuration, if any."""
    return parameter(config, PROFILE_PARAMETER)


def served_by_vllm(config: Mapping[str, Any]) -> bool:
    """Whether Triton serves the model with vLLM, whose engine arguments live in `model.json`."""
    return config.get("backend") == VLLM_BACKEND


def applied_engine_arguments(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine arguments batchpilot set on this served configuration, if it set any (None
    too when the parameter is malformed: what the engine runs is then unknown)."""
    return json_parameter(config, ENGINE_ARGUMENTS_PARAMETER)


def engine_max_num_seqs(
    config: Mapping[str, Any], model_json: Mapping[str, Any] | None = None
) -> int | None:
    """The most sequences the vLLM engine of this served configuration runs at once (its
    `max_num_seqs`), given the repository's `model.json` when the reader has it. None for another
    backend, or when neither the file nor batchpilot's arguments set it (vLLM's default depends
    on its version and the device)."""
    if not served_by_vllm(config):
        return None
    applied = applied_engine_arguments(config)
    if applied is None and parameter(config, ENGINE_ARGUMENTS_PARAMETER) is not None:
        return None  # a parameter batchpilot did not write: what the engine runs is unknown
    value = {**(model_json or {}), **(applied or {})}.get("max_num_seqs")
    # JSON's true is no count of sequences, though Python's bool is an int.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def baseline_max_batch_size(config: Mapping[str, Any]) -> int:
    """The model's own max_batch_size, from its repository configuration. A stored baseline that
    is not a count is ignored (`malformed_parameters`): the served max_batch_size is then the
    most the model is known to take, since a profile only ever lowers it."""
    stored = _count(parameter(config, BASELINE_PARAMETER))
    return stored if stored is not None else int(config.get("max_batch_size", 0))


@dataclass(frozen=True, kw_only=True)
class ServedBatching:
    """The batching a model is served with, as the sidecar reports and reasons about it."""

    max_batch_size: int
    max_queue_delay_us: int | None
    """None when the model has no dynamic batching."""
    preferred_batch_sizes: tuple[int, ...] = ()
    memory_per_item_bytes: float | None = None
    max_num_seqs: int | None = None
    """For a model served by vLLM, the most sequences its engine runs at once, when known."""

    @classmethod
    def from_model_config(
        cls, config: Mapping[str, Any], *, model_json: Mapping[str, Any] | None = None
    ) -> ServedBatching:
        """The served configuration's batching; `model_json`: the repository's engine arguments
        of a model served by vLLM, when the reader has the repository."""
        batching = config.get("dynamic_batching")
        if not isinstance(batching, Mapping):
            batching = None
        declared = parameter(config, MEMORY_PER_ITEM_PARAMETER)
        return cls(
            max_batch_size=int(config.get("max_batch_size", 0)),
            max_queue_delay_us=(
                int(batching.get("max_queue_delay_microseconds", 0)) if batching else None
            ),
            preferred_batch_sizes=tuple(
                int(size) for size in (batching or {}).get("preferred_batch_size", [])
            ),
            memory_per_item_bytes=float(declared) if declared else None,
            max_num_seqs=engine_max_num_seqs(config, model_json),
        )
