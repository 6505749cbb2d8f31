"""The formats the chart ships the alerts in, and YAML as the generated files write it.

Prometheus reads plain rule groups (what `promtool check rules` reads and the chart's
PrometheusRule wraps unchanged); Grafana-managed alerting reads its own file-provisioning format.
Both are built from `alerts.ALERTS`, so the two cannot disagree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import yaml

from batchpilot_charts import alerts, dashboards

RULE_GROUP = "batchpilot"
GRAFANA_FOLDER = "batchpilot"
GRAFANA_DATASOURCE_UID = "prometheus"
"""The data source the Grafana alert rules query: kube-prometheus-stack's default uid; the chart
replaces it with `grafana.alerts.datasourceUid`."""


def prometheus_rules() -> dict[str, Any]:
    """Plain Prometheus rule groups (what `promtool check rules` reads)."""
    rules = []
    for alert in alerts.ALERTS:
        rule: dict[str, Any] = {"alert": alert.name, "expr": alert.expr}
        if alert.for_:
            rule["for"] = alert.for_
        rule["labels"] = {"severity": alert.severity}
        rule["annotations"] = {
            "summary": alert.summary,
            "description": alert.description,
            "runbook": alert.runbook_text(),
        }
        rules.append(rule)
    return {"groups": [{"name": RULE_GROUP, "rules": rules}]}


def _grafana_template(text: str) -> str:
    # Grafana's templates know the query's value as $values.A.Value rather than $value.
    return text.replace("$value", "$values.A.Value")


def _grafana_uid(name: str) -> str:
    # Grafana rule uids are at most 40 characters of [a-zA-Z0-9-_].
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()[:40]


def grafana_alert_rules() -> dict[str, Any]:
    """The same alerts in Grafana's file-provisioning format.

    Each rule runs the PromQL expression (A) and fires for every series it returns, as
    Prometheus does: B is 1 for any value, C holds where B is above 0 (Grafana's own conversion
    of Prometheus rules builds the same three steps).
    """
    rules = []
    for alert in alerts.ALERTS:
        query = {"refId": "A", "expr": alert.expr, "instant": True, "range": False}
        any_value = {
            "refId": "B",
            "type": "math",
            "expression": "is_number($A) || is_nan($A) || is_inf($A)",
        }
        condition = {
            "refId": "C",
            "type": "threshold",
            "expression": "B",
            "conditions": [{"evaluator": {"type": "gt", "params": [0]}}],
        }
        rules.append(
            {
                "uid": _grafana_uid(alert.name),
                "title": alert.name,
                "condition": "C",
                "data": [
                    {
                        "refId": "A",
                        "relativeTimeRange": {"from": 600, "to": 0},
                        "datasourceUid": GRAFANA_DATASOURCE_UID,
                        "model": query,
                    },
                    {"refId": "B", "datasourceUid": "__expr__", "model": any_value},
                    {"refId": "C", "datasourceUid": "__expr__", "model": condition},
                ],
                "noDataState": "OK",
                "execErrState": "Error",
                "for": alert.for_ or "0s",
                "labels": {"severity": alert.severity},
                "annotations": {
                    "summary": _grafana_template(alert.summary),
                    "description": _grafana_template(alert.description),
                    "runbook": alert.runbook_text(),
                    # Grafana refuses a dashboard link without its panel, and one refused
                    # rule stops its provisioning and the server with it.
                    "__dashboardUid__": dashboards.DASHBOARD_UID,
                    "__panelId__": str(dashboards.panel_id(alert.panel)),
                },
            }
        )
    group = {
        "orgId": 1,
        "name": RULE_GROUP,
        "folder": GRAFANA_FOLDER,
        "interval": "1m",
        "rules": rules,
    }
    return {"apiVersion": 1, "groups": [group]}


class _Dumper(yaml.SafeDumper):
    """Block scalars for multi-line strings, so expressions and runbooks read as written."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def yaml_text(document: Mapping[str, Any], *, header: str) -> str:
    """A document as the generated YAML files read: its header comment, then the document."""
    return header + yaml.dump(
        document, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True
    )


def json_text(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
