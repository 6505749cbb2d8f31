"""`batchpilot demo`: an entry point of the `batchpilot.commands` group (pyproject.toml), so the
product's command line offers the demo without importing the harness.

This module only declares arguments; the demo (Triton, load, the runner) is imported when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "a local Triton, the demo model, a policy and load: watch it switch"
DESCRIPTION = (
    "Start a local tritonserver (CPU) with the gpu_sim demo model, run the standalone runner "
    "with a compressed schedule and a load rule, drive quiet and busy load, print a live view "
    "and a summary per profile. Leaves nothing running."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--short", action="store_true", help="a shorter run (about a minute)")
    parser.add_argument(
        "--model",
        choices=("gpu_sim", "torch_mlp", "llm"),
        default="gpu_sim",
        help="llm: a real vLLM engine behind Triton switching engine settings (builds its "
        "environment first, about 4 minutes and 6 GB the first time)",
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        help="the demo model repository (default: manifests/model-repository of this checkout)",
    )


def run(arguments: argparse.Namespace) -> int:
    if arguments.model == "llm":
        from batchpilot_harness import llm_demo

        return llm_demo.main(short=arguments.short)
    from batchpilot_harness import demo  # needs the [triton] extra; loaded only to run

    return demo.main(
        short=arguments.short, model=arguments.model, model_repository=arguments.model_repository
    )
