"""The API server's audit log, kept for the operator's requests only: how many requests, of which
verb and resource, the operator makes (bench_scale reports them per minute).

The policy logs at the Metadata level (who, what, when; no bodies) every request from a service
account of `AUDITED_NAMESPACE`, where the test bed runs the operator as its own ServiceAccount
(`batchpilot_testbed.operators`), and nothing else, so the controllers' and the kubelet's traffic
costs nothing. Each request is counted once: when its response completed, or, for a watch (whose
response completes only when it ends), when its response started.
"""

from __future__ import annotations

import collections
import datetime
import json
from pathlib import Path

AUDITED_NAMESPACE = "batchpilot-system"
LONG_RUNNING = frozenset({"watch"})
MAX_LOG_MEGABYTES = 200


def policy_text(namespace: str = AUDITED_NAMESPACE) -> str:
    return (
        "apiVersion: audit.k8s.io/v1\n"
        "kind: Policy\n"
        "omitStages: [RequestReceived]\n"
        "rules:\n"
        "  - level: Metadata\n"
        f"    userGroups: ['system:serviceaccounts:{namespace}']\n"
        "  - level: None\n"
    )


def apiserver_flags(state_dir: Path) -> list[str]:
    """kube-apiserver's flags for this audit log; writes the policy they name."""
    policy = state_dir / "audit-policy.yaml"
    policy.write_text(policy_text())
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log_path(state_dir)}",
        f"--audit-log-maxsize={MAX_LOG_MEGABYTES}",
        "--audit-log-maxbackup=1",
    ]


def log_path(state_dir: Path) -> Path:
    return state_dir / "logs" / "audit.log"


def requests(
    log: Path, *, user: str, since: datetime.datetime, until: datetime.datetime
) -> collections.Counter[str]:
    """The requests `user` made that the API server received in [since, until), counted by
    "verb resource" (with its subresource: "patch batchpolicies/status")."""
    counted: collections.Counter[str] = collections.Counter()
    if not log.exists():
        return counted
    with log.open(encoding="utf-8") as lines:
        for line in lines:
            event = json.loads(line)
            if event.get("user", {}).get("username") != user:
                continue
            verb = event.get("verb", "")
            wanted = "ResponseStarted" if verb in LONG_RUNNING else "ResponseComplete"
            if event.get("stage") != wanted:
                continue
            received = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"])
            if not since <= received < until:
                continue
            counted[f"{verb} {_resource(event.get('objectRef') or {})}"] += 1
    return counted


def _resource(reference: dict[str, str]) -> str:
    resource = reference.get("resource", "-")
    subresource = reference.get("subresource")
    return f"{resource}/{subresource}" if subresource else resource
