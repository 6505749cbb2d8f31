"""The local cluster's audit log, read as bench_scale reads it: each of the operator's requests
once, in its window, by verb and resource."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import yaml

from batchpilot_cluster import audit

OPERATOR = "system:serviceaccount:batchpilot-system:batchpilot-operator"
T0 = datetime.datetime(2026, 11, 27, 12, 0, tzinfo=datetime.UTC)


def event(
    *, audit_id: str, verb: str, stage: str, seconds: float, user: str = OPERATOR, **reference: str
) -> str:
    received = (T0 + datetime.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")
    return json.dumps(
        {
            "auditID": audit_id,
            "stage": stage,
            "verb": verb,
            "user": {"username": user},
            "objectRef": reference,
            "requestReceivedTimestamp": received,
        }
    )


def test_the_policy_keeps_the_operator_s_namespace_and_drops_the_rest() -> None:
    policy = yaml.safe_load(audit.policy_text())
    assert policy["kind"] == "Policy"
    first, last = policy["rules"]
    assert first == {
        "level": "Metadata",
        "userGroups": [f"system:serviceaccounts:{audit.AUDITED_NAMESPACE}"],
    }
    assert last == {"level": "None"}


def test_each_request_counts_once_by_verb_and_resource_in_its_window(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = [
        event(audit_id="a", verb="patch", stage="ResponseComplete", seconds=1,
              resource="batchpolicies", subresource="status"),
        event(audit_id="b", verb="create", stage="ResponseComplete", seconds=2, resource="events"),
        # A watch completes only when it ends: it counts when its response starts.
        event(audit_id="c", verb="watch", stage="ResponseStarted", seconds=3, resource="pods"),
        event(audit_id="c", verb="watch", stage="ResponseComplete", seconds=3, resource="pods"),
        # Someone else's request, and requests outside the window.
        event(audit_id="d", verb="list", stage="ResponseComplete", seconds=4, resource="pods",
              user="system:kube-scheduler"),
        event(audit_id="e", verb="get", stage="ResponseComplete", seconds=-1, resource="pods"),
        event(audit_id="f", verb="get", stage="ResponseComplete", seconds=60, resource="pods"),
    ]  # fmt: skip
    log.write_text("\n".join(lines) + "\n")
    counted = audit.requests(
        log, user=OPERATOR, since=T0, until=T0 + datetime.timedelta(seconds=60)
    )
    assert counted == {"patch batchpolicies/status": 1, "create events": 1, "watch pods": 1}


def test_no_log_is_no_requests(tmp_path: Path) -> None:
    assert not audit.requests(tmp_path / "absent.log", user=OPERATOR, since=T0, until=T0)
