"""The `batchpilot` command: one console script, one subcommand per job.

`explain`, `run` and `operator` are this package's. Other packages add commands through the
`batchpilot.commands` entry points (pyproject.toml): the sidecar its `sidecar`, the harness its
`demo`. This package never imports them, and an installation without them (the operator's
image) says so when one is asked for. A command module offers `HELP`, `DESCRIPTION`,
`add_arguments(parser)` and `run(arguments) -> int`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from batchpilot import __version__, explaining
from batchpilot.api import documents, names
from batchpilot.applying import credentials
from batchpilot.kube import logins
from batchpilot.policy import governing
from batchpilot_triton import endpoints

if TYPE_CHECKING:
    from batchpilot.admission import webhooks

PLUGIN_GROUP = "batchpilot.commands"
ADDED_ELSEWHERE = {
    "demo": "it comes with batchpilot's tooling, from a checkout: `make demo`",
    "sidecar": "it comes with the batchpilot-sidecar distribution",
}
"""Commands other distributions add, and where from: an installation without one says so."""
REPOSITORY_TOKEN_ENV = "BATCHPILOT_REPOSITORY_TOKEN"  # noqa: S105 - a variable name, not a value


def _read_named_policy(path: Path) -> documents.NamedPolicy:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise documents.PolicyError(
            [documents.Problem(str(path), error.strerror or str(error))]
        ) from None
    return documents.parse_yaml_policy(text, default_name=path.stem)


def _explain(arguments: argparse.Namespace) -> int:
    named = _read_named_policy(arguments.policy)
    spec = named.spec
    signals = explaining.parse_signals(arguments.signal)
    at = (
        explaining.parse_instant(arguments.at, spec)
        if arguments.at
        else datetime.datetime.now(datetime.UTC)
    )
    lead = explaining.lead(spec, replicas=arguments.replicas, wave_seconds=arguments.wave_seconds)
    decision = explaining.explain(spec, at, signals, lead)
    if arguments.output == "json":
        found = explaining.as_json(spec, at, signals, decision, named.status)
        print(json.dumps(found, indent=2))
    else:
        print(explaining.as_text(spec, at, signals, decision, lead, named.status))
    return 0


def _run(arguments: argparse.Namespace) -> int:
    # Imported here so that `explain` starts fast, without the network stack.
    from batchpilot import running

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    named = _read_named_policy(arguments.policy)
    return asyncio.run(
        running.run_standalone(
            name=named.name,
            namespace=named.namespace,
            spec=named.spec,
            triton_urls=arguments.triton,
            metrics_urls=arguments.triton_metrics,
            interval=arguments.interval,
            listen=_listen(arguments.listen, option="--listen"),
            sidecar_urls=arguments.sidecar,
            model_repository=arguments.model_repository,
            ticks=arguments.ticks,
            credential_source=_repository_credential(arguments.repository_token_file),
        )
    )


def _repository_credential(token_file: Path | None) -> credentials.CredentialSource:
    """The runner's repository credential: from a file, or the environment; never from its
    command line, which anyone on the machine can read (ps)."""
    if token_file is not None:
        try:
            given = token_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            # Not the path: a value given by mistake for a path must not reach the log.
            why = error.strerror if isinstance(error, OSError) else None
            raise SystemExit(
                f"--repository-token-file: cannot read it: {why or type(error).__name__}"
            ) from None
        return credentials.GivenCredential(given, source=f"--repository-token-file {token_file}")
    from_environment = os.environ.get(REPOSITORY_TOKEN_ENV)
    if from_environment:
        return credentials.GivenCredential(from_environment, source=REPOSITORY_TOKEN_ENV)
    return credentials.NoCredentials(
        hint=f"the runner was given no value (set {REPOSITORY_TOKEN_ENV} or "
        "--repository-token-file)"
    )


def keep_the_kubernetes_client_out() -> None:
    """Make the Kubernetes client unimportable in this process: kopf imports its models
    whenever it is installed (34 MiB), and the operator hands kopf dicts only. A legacy auth
    provider's login, the one use of it, runs in a child process (`logins`). Called before kopf
    is first imported."""
    sys.modules.setdefault("kubernetes", None)  # type: ignore[arg-type]


def _operator(arguments: argparse.Namespace) -> int:
    keep_the_kubernetes_client_out()
    import kopf  # the operator's stack is loaded only for this command

    from batchpilot import handlers, operating

    kopf.configure(verbose=arguments.verbose)
    listen = _listen(arguments.metrics_listen, option="--metrics-listen")
    options = operating.Options(
        interval=arguments.interval,
        settle_seconds=arguments.settle_seconds,
        metrics_host=listen[0] if listen else "",
        metrics_port=listen[1] if listen else None,
        verbose=arguments.verbose,
        limits=governing.Limits(
            policies_per_namespace=arguments.max_policies_per_namespace,
            pods_per_policy=arguments.max_pods_per_policy,
        ),
    )
    return handlers.run(
        options=options,
        webhook=_webhook(arguments),
        namespaces=arguments.namespace,
        standalone=arguments.standalone,
        peering=arguments.peering,
        priority=arguments.priority,
        liveness=None if arguments.liveness == "none" else arguments.liveness,
    )


def _webhook(arguments: argparse.Namespace) -> webhooks.WebhookOptions | None:
    """The admission webhook's options, or None when it is not served; refuses half of them."""
    if arguments.webhook_listen is None:
        return None
    from batchpilot.admission import injections, webhooks  # kopf's stack, as in _operator

    if arguments.webhook_certificates is None or not arguments.sidecar_image:
        raise ValueError("--webhook-listen needs --webhook-certificates and --sidecar-image")
    webhooks.check_certificates(arguments.webhook_certificates)
    host, port = _listen(arguments.webhook_listen, option="--webhook-listen") or ("", 0)
    return webhooks.WebhookOptions(
        host=host,
        port=port,
        certificates=arguments.webhook_certificates,
        injection=injections.Settings(
            sidecar_image=arguments.sidecar_image,
            sidecar_pull_policy=arguments.sidecar_pull_policy,
            operator_namespace=arguments.own_namespace,
            credential_secret=arguments.repository_credential,
            dcgm_url=arguments.dcgm_url,
        ),
    )


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return number


def _listen(text: str, *, option: str) -> tuple[str, int] | None:
    """`HOST:PORT` for a metrics endpoint; `none` turns it off."""
    if text == "none":
        return None
    return endpoints.parse_listen(text, option=option, example="127.0.0.1:9401, or none")


def _plugins() -> list[tuple[str, ModuleType | Exception]]:
    """The commands other packages add, each loaded, or the error that kept it out; a known
    command no installed distribution adds, with where it comes from."""
    found: dict[str, ModuleType | Exception] = {}
    for entry in metadata.entry_points(group=PLUGIN_GROUP):
        try:
            found[entry.name] = entry.load()
        except ImportError as error:
            found[entry.name] = error
    for name, where in ADDED_ELSEWHERE.items():
        found.setdefault(name, LookupError(where))
    return sorted(found.items())


def _unavailable(name: str, error: Exception) -> int:
    print(f"batchpilot {name}: not part of this installation ({error})", file=sys.stderr)
    return 2


def _add_plugin(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    plugin: ModuleType | Exception,
) -> None:
    if isinstance(plugin, Exception):
        unavailable = commands.add_parser(name, help="(not installed here)", add_help=False)
        unavailable.set_defaults(
            handler=lambda _, error=plugin: _unavailable(name, error), any_arguments=True
        )
        return
    parser = commands.add_parser(name, help=plugin.HELP, description=plugin.DESCRIPTION)
    plugin.add_arguments(parser)
    parser.set_defaults(handler=plugin.run)


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
    explain.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas the policy governs, for schedule.leadTime auto (default 1)",
    )
    explain.add_argument(
        "--wave-seconds",
        type=float,
        metavar="SECONDS",
        help="how long one rollout wave takes (status.measuredWaveSeconds); default: assumed",
    )
    explain.add_argument("-o", "--output", choices=("text", "json"), default="text")
    explain.set_defaults(handler=_explain)

    run = commands.add_parser(
        "run",
        # No abbreviations: `--repository-token VALUE` must not pass for the file option.
        allow_abbrev=False,
        help="make Triton servers follow a policy, without Kubernetes",
        description="Each tick: read load signals (from Triton's metrics, or from sidecars with "
        "--sidecar), decide, and apply the "
        "decided profile to every server, one after another, repairing drift (e.g. after a "
        "server restart). Stops cleanly on SIGTERM or Ctrl-C.",
    )
    run.add_argument(
        "--policy",
        type=Path,
        required=True,
        help="BatchPolicy YAML file; its metadata.namespace, if any, labels the metrics "
        "(policy_namespace) as the operator's do",
    )
    run.add_argument(
        "--triton",
        action="append",
        required=True,
        metavar="URL",
        help="Triton HTTP endpoint, e.g. http://10.0.0.5:8000 (repeatable); the server must run "
        "with --model-control-mode=explicit",
    )
    run.add_argument(
        "--triton-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="Triton metrics URL per --triton, in the same order (default: same host, port 8002)",
    )
    run.add_argument(
        "--sidecar",
        action="append",
        default=[],
        metavar="URL",
        help=f"a batchpilot sidecar, e.g. http://10.0.0.5:{endpoints.SIDECAR_PORT} (repeatable): "
        "load signals and the SLO autotune recommendation come from the sidecars when "
        "spec.load.source is sidecar (the default); one per --triton, in the same order, tells "
        "a canary (spec.rollout.canary) whose figures are whose",
    )
    run.add_argument(
        "--model-repository",
        type=Path,
        metavar="DIR",
        help="the model repository the servers load from: LLM models served by Triton's vLLM "
        "backend take a profile's llm settings in a model.json built on this repository's",
    )
    run.add_argument(
        "--repository-token-file",
        type=Path,
        metavar="FILE",
        help="the value of the header that Triton's restricted model-repository API expects "
        f"(or set {REPOSITORY_TOKEN_ENV}); sent under the header the policy's "
        "target.repositoryCredential names, else batchpilot-repository-token",
    )
    run.add_argument("--interval", type=float, default=5.0, help="seconds between ticks")
    run.add_argument(
        "--listen",
        default=f"127.0.0.1:{endpoints.RUNNER_METRICS_PORT}",
        help="HOST:PORT for the runner's /metrics and /healthz, or none",
    )
    run.add_argument("--ticks", type=int, help=argparse.SUPPRESS)
    run.set_defaults(handler=_run)

    operator = commands.add_parser(
        "operator",
        help="run the Kubernetes operator (kopf) that makes Triton Pods follow BatchPolicies",
        description="Reconcile every BatchPolicy: on changes, when target Pods change, at each "
        "scheduled transition and every --interval seconds. Runs until SIGTERM. Logs in with "
        "the Pod's ServiceAccount in a cluster, else as the kubeconfig's current user (KUBECONFIG "
        "or ~/.kube/config): its token or certificate, or what its exec plugin prints (run with "
        f"a {logins.EXEC_SECONDS:g} s deadline); a legacy auth provider without a token is "
        "logged in by the Kubernetes client library (`pip install kubernetes`) in a child "
        "process, under the same deadline.",
    )
    operator.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve only this namespace (repeatable); default: all namespaces",
    )
    operator.add_argument("--interval", type=float, default=5.0, help="seconds between ticks")
    operator.add_argument(
        "--settle-seconds",
        type=float,
        default=1.5,
        help="after taking a gated Pod out of its Services, wait this long before watching its "
        "queue drain (endpoint changes take a moment to reach every proxy)",
    )
    operator.add_argument(
        "--metrics-listen",
        default=f"{endpoints.EVERY_ADDRESS}:{endpoints.OPERATOR_METRICS_PORT}",
        help="HOST:PORT for /metrics, or none",
    )
    operator.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf's liveness endpoint URL, or none",
    )
    operator.add_argument(
        "--standalone", action="store_true", help="no peering: run even if other replicas run"
    )
    operator.add_argument(
        "--peering",
        default="batchpilot",
        help="the (Cluster)KopfPeering object replicas use to elect the active one",
    )
    operator.add_argument(
        "--priority", type=int, help="peering priority (default: random, so one replica leads)"
    )
    limits = governing.Limits()
    operator.add_argument(
        "--max-policies-per-namespace",
        type=_positive,
        default=limits.policies_per_namespace,
        help="a namespace's policies beyond the oldest this many govern no Pod (LimitExceeded)",
    )
    operator.add_argument(
        "--max-pods-per-policy",
        type=_positive,
        default=limits.pods_per_policy,
        help="a policy governs at most this many Pods, the first by name (LimitExceeded)",
    )
    operator.add_argument("--verbose", action="store_true", help="kopf's verbose logging")
    webhook = operator.add_argument_group(
        "admission webhook",
        f"Serve the mutating webhook that injects what batchpilot needs into Pods labelled "
        f"{names.INJECT_SELECTOR} (the chart's MutatingWebhookConfiguration sends them).",
    )
    webhook.add_argument(
        "--webhook-listen", metavar="HOST:PORT", help="serve the webhook (HTTPS) here; default: no"
    )
    webhook.add_argument(
        "--webhook-certificates",
        type=Path,
        metavar="DIR",
        help="the folder with the webhook's tls.crt and tls.key",
    )
    webhook.add_argument(
        "--sidecar-image", metavar="IMAGE", help="the image of the sidecar the webhook injects"
    )
    webhook.add_argument(
        "--sidecar-pull-policy", choices=("Always", "IfNotPresent", "Never"), help="its pull policy"
    )
    webhook.add_argument(
        "--dcgm-url", metavar="URL", help="the injected sidecar's --dcgm-url (the node's exporter)"
    )
    webhook.add_argument(
        "--repository-credential",
        default="triton-repository-credential",
        metavar="SECRET",
        help="the Secret whose token locks an injected Triton's model-repository API, unless the "
        f"Pod's {names.REPOSITORY_CREDENTIAL_ANNOTATION} names another",
    )
    webhook.add_argument(
        "--own-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        metavar="NAMESPACE",
        help="never inject into Pods of this namespace (default: $POD_NAMESPACE)",
    )
    operator.set_defaults(handler=_operator)

    for name, plugin in _plugins():
        _add_plugin(commands, name, plugin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(arguments, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
