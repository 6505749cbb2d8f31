"""The LLM test world: a tiny Llama served by a real vLLM engine behind Triton, on the CPU.

`manifests/llm-repository/tiny_llm` is laid out the way NVIDIA's vLLM backend lays out a model:
a complete config (`backend: "vllm"`, decoupled) and the engine arguments in `1/model.json`.
The model has no weights to download: `manifests/llm-models/tiny-llama` is a Llama config (256
hidden, 4 layers, vocabulary 1,024) that vLLM fills with dummy weights. `model.json` must name it
by absolute path, so the repository is written out per run (`write_repository`). The backend is
`manifests/backends/vllm`, in the vLLM environment of `batchpilot_harness.llm_env`.

One engine takes about 4 GiB and 15-30 s to start: run one at a time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchpilot_harness import llm_env, local_triton

_MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
REPOSITORY_TEMPLATE = _MANIFESTS / "llm-repository"
BACKENDS = _MANIFESTS / "backends"
WEIGHTS_CONFIG = _MANIFESTS / "llm-models" / "tiny-llama"
LLM_MODEL = "tiny_llm"
ENGINE_ARGUMENTS_FILE = "model.json"

ENGINE_KVCACHE_GIB = 1
"""The KV cache each CPU engine reserves (VLLM_CPU_KVCACHE_SPACE)."""
ENGINE_THREAD_BINDING = "nobind"
"""VLLM_CPU_OMP_THREADS_BIND for every engine of the test world. By default ("auto") a CPU
engine pins its worker, every thread of it, to a core it picks. On these 2-core machines a nice-0
process that sleeps 300 ms then woke up over 0.3 s late 11 and 13 times in two runs of
tests/integration/test_llm.py (up to 1.47 s), and 0 times unbound, the tests as fast; with a core
kept busy, 23 times (up to 1.54 s) pinned and 11 (up to 1.17 s) unbound. Tritons beside an engine
stall with it, and Triton 2.51 fails the batch in flight of a Python-backend stub that has not run
for a second ("Stub process ... is not healthy"), then often crashes:
docs/concepts/reliability.md."""
ENGINE_THREADS = 1
"""OMP_NUM_THREADS for the engines: the one thread the default binding gave them here (it keeps a
core for the rest), with which the LLM tests' figures were measured. Unbound, vLLM leaves the
count to torch, a thread per core, and the engine's step-time fit failed its test in the one run
made so beside a busy core."""
READY_SECONDS = 300.0
"""How long a server waits for its engine: 15-30 s on an idle machine, minutes on a busy one."""


def base_engine_arguments() -> dict[str, Any]:
    """The repository's `model.json`: what a user's would say for this model, on a CPU."""
    return {
        "model": str(WEIGHTS_CONFIG),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": False,
    }


def write_repository(directory: Path, engine_arguments: Mapping[str, Any] | None = None) -> Path:
    """A model repository in `directory` holding `tiny_llm`, with these engine arguments on top
    of `base_engine_arguments()`; returns the repository path."""
    repository = directory / "llm-repository"
    shutil.rmtree(repository, ignore_errors=True)
    shutil.copytree(REPOSITORY_TEMPLATE, repository)
    version = repository / LLM_MODEL / "1"
    version.mkdir(parents=True, exist_ok=True)
    arguments = {**base_engine_arguments(), **(engine_arguments or {})}
    (version / ENGINE_ARGUMENTS_FILE).write_text(json.dumps(arguments, indent=2) + "\n")
    return repository


def server(
    repository: Path, *, run_directory: Path | None = None, **options: Any
) -> local_triton.LocalTriton:
    """A LocalTriton serving `tiny_llm` from `repository` with the vLLM environment (built
    first if it is not cached yet)."""
    environment = llm_env.build()
    options.setdefault("ready_timeout", READY_SECONDS)
    return local_triton.LocalTriton(
        model_repository=repository,
        models=[LLM_MODEL],
        run_directory=run_directory,
        interpreter=llm_env.python(environment),
        python_backends={"vllm": BACKENDS / "vllm"},
        environment={
            "VLLM_CPU_KVCACHE_SPACE": str(ENGINE_KVCACHE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": ENGINE_THREAD_BINDING,
            "OMP_NUM_THREADS": str(ENGINE_THREADS),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        },
        **options,
    )
