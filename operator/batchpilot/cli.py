"""The `batchpilot` command: one console script, one subcommand per job."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from batchpilot import __version__, explaining
from batchpilot.policy import documents, specs


def _read_policy(path: Path) -> specs.BatchPolicySpec:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise documents.PolicyError(
            [documents.Problem(str(path), error.strerror or str(error))]
        ) from None
    return documents.parse_yaml(text)


def _explain(arguments: argparse.Namespace) -> int:
    spec = _read_policy(arguments.policy)
    signals = explaining.parse_signals(arguments.signal)
    at = (
        explaining.parse_instant(arguments.at, spec)
        if arguments.at
        else datetime.datetime.now(datetime.UTC)
    )
    decision = explaining.explain(spec, at, signals)
    if arguments.output == "json":
        print(json.dumps(explaining.as_json(spec, at, signals, decision), indent=2))
    else:
        print(explaining.as_text(spec, at, signals, decision))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchpilot",
        description="Policy-driven dynamic batching for NVIDIA Triton Inference Server.",
    )
    parser.add_argument("--version", action="version", version=f"batchpilot {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    explain = commands.add_parser(
        "explain",
        help="what a policy decides at an instant, why, and when it next changes",
        description="Show the profile a policy chooses at an instant, the reason, the next "
        "transition and the Triton dynamic_batching message it would apply. Signals given with "
        "--signal are taken as steady (held longer than any rule's `for`).",
    )
    explain.add_argument("--policy", type=Path, required=True, help="BatchPolicy YAML file")
    explain.add_argument(
        "--at",
        help="ISO 8601 instant (default: now); without an offset it is read in the schedule's "
        "time zone",
    )
    explain.add_argument(
        "--signal",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a load signal, e.g. queueDepth=250 (repeatable); names: "
        + ", ".join(explaining.SIGNAL_NAMES),
    )
    explain.add_argument("-o", "--output", choices=("text", "json"), default="text")
    explain.set_defaults(handler=_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        exit_code: int = arguments.handler(arguments)
    except documents.PolicyError as error:
        print(f"batchpilot {arguments.command}: invalid policy", file=sys.stderr)
        for problem in error.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"batchpilot {arguments.command}: {error}", file=sys.stderr)
        return 2
    return exit_code
