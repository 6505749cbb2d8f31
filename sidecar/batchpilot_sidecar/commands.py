"""The sidecar's command line: `python -m batchpilot_sidecar` (what its image runs), and
`batchpilot sidecar` where the whole of batchpilot is installed (an entry point of the
`batchpilot.commands` group: the `batchpilot` command finds it without importing this package).

This module only declares arguments; the sidecar itself is imported when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from batchpilot_triton import endpoints

HELP = "GPU and Triton telemetry next to one Triton server, with recommendations"
DESCRIPTION = (
    "Every interval: read NVML (or a DCGM exporter), Triton's metrics and its statistics "
    "extension; fit each model's step time t0 + c*b^alpha; serve /metrics "
    "(batchpilot_sidecar_*), /status (JSON; ?sloP95Ms=... for a queue-delay recommendation, "
    "?ttftP95Ms=...&itlP95Ms=... for an LLM engine's maxNumSeqs and maxNumBatchedTokens) and "
    "/healthz; with --model-repository, an LLM model's engine arguments (its model.json) at "
    "/v1/models/MODEL/engine-arguments, for the operator. Works without a GPU and says so. Stops "
    "cleanly on SIGTERM or Ctrl-C."
)


def default_pod_name(environment: Mapping[str, str]) -> str | None:
    """The Pod this sidecar runs in: $POD_NAME (the manifests set it from the downward API), else
    the Pod's hostname, but only in a Kubernetes Pod: elsewhere $HOSTNAME names a machine, and a
    DCGM page without Pod labels there is the machine's own."""
    if environment.get("POD_NAME"):
        return environment["POD_NAME"]
    if environment.get("KUBERNETES_SERVICE_HOST"):
        return environment.get("HOSTNAME") or None
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--triton-url",
        required=True,
        metavar="URL",
        help="Triton HTTP endpoint, e.g. http://127.0.0.1:8000",
    )
    parser.add_argument(
        "--metrics-url", metavar="URL", help="Triton metrics (default: same host, port 8002)"
    )
    parser.add_argument(
        "--listen",
        default=f"{endpoints.EVERY_ADDRESS}:{endpoints.SIDECAR_PORT}",
        help="HOST:PORT for /metrics, /status, /healthz",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    parser.add_argument(
        "--dcgm-url", metavar="URL", help="a DCGM exporter's /metrics, used when NVML gives nothing"
    )
    parser.add_argument(
        "--pod-name",
        default=default_pod_name(os.environ),
        help="keep only this Pod's GPUs of a DCGM exporter's page (default: $POD_NAME, else "
        "$HOSTNAME in a Kubernetes Pod; outside one, every GPU of the page)",
    )
    parser.add_argument(
        "--pod-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="and only in this namespace: Pod names repeat across namespaces (default: "
        "$POD_NAMESPACE)",
    )
    parser.add_argument(
        "--slo-p95-ms",
        type=float,
        metavar="MS",
        help="p95 objective for the recommendation gauges on /metrics (/status takes its own)",
    )
    parser.add_argument(
        "--ttft-p95-ms",
        type=float,
        metavar="MS",
        help="LLM engines: p95 time-to-first-token objective when /status names none",
    )
    parser.add_argument(
        "--itl-p95-ms",
        type=float,
        metavar="MS",
        help="LLM engines: p95 inter-token latency objective when /status names none",
    )
    parser.add_argument(
        "--models", metavar="A,B", help="only these models (default: every model Triton serves)"
    )
    parser.add_argument(
        "--max-models", type=int, default=64, help="most models tracked at once (memory bound)"
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        metavar="DIR",
        help="Triton's model repository, mounted read-only: the operator reads the model.json "
        "of models served by Triton's vLLM backend from here to apply LLM profiles, and the "
        "sidecar the most sequences their engines run",
    )
    parser.add_argument(
        "--rate-window", type=float, default=10.0, help="seconds over which rates are reported"
    )
    parser.add_argument(
        "--fit-window", type=float, default=600.0, help="seconds of step-time observations fitted"
    )


def run(arguments: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM or Ctrl-C. Invalid arguments raise ValueError."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from batchpilot_sidecar import collecting, gpus, llm_recommending, recommending, serving

    if arguments.model_repository is not None and not arguments.model_repository.is_dir():
        raise ValueError(f"--model-repository {arguments.model_repository} is not a directory")
    objective = (
        recommending.Objective(p95_ms=arguments.slo_p95_ms) if arguments.slo_p95_ms else None
    )
    return asyncio.run(
        serving.run_sidecar(
            triton_url=arguments.triton_url,
            metrics_url=arguments.metrics_url,
            listen=endpoints.parse_listen(
                arguments.listen, example=f"0.0.0.0:{endpoints.SIDECAR_PORT}"
            ),
            settings=collecting.Settings(
                interval=arguments.interval,
                rate_window=arguments.rate_window,
                fit_window=arguments.fit_window,
                max_models=arguments.max_models,
            ),
            dcgm_url=arguments.dcgm_url,
            pod=gpus.PodRef(arguments.pod_name, arguments.pod_namespace)
            if arguments.pod_name
            else None,
            default_objective=objective,
            default_llm_objective=llm_recommending.LlmObjective(
                ttft_p95_ms=arguments.ttft_p95_ms, itl_p95_ms=arguments.itl_p95_ms
            ),
            models=[name for name in (arguments.models or "").split(",") if name],
            model_repository=arguments.model_repository,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_sidecar", description=DESCRIPTION)
    add_arguments(parser)
    arguments = parser.parse_args(argv)
    try:
        return run(arguments)
    except ValueError as error:
        print(f"batchpilot sidecar: {error}", file=sys.stderr)
        return 2
