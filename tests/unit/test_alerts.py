"""The alerts: documented, tested with promtool, and the same rules for Prometheus and Grafana."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from batchpilot import telemetry
from batchpilot_charts import alerts, dashboards, queries
from batchpilot_sidecar import telemetry as sidecar_telemetry

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchpilot"
ALERT_TESTS = CHART / "tests" / "alerts_test.yaml"


@pytest.mark.parametrize(
    ("template", "generated"),
    [
        ("prometheusrule.yaml", "files/alerts.yaml"),
        ("configmap-grafana-alerts.yaml", "files/grafana-alerts.yaml"),
        ("configmap-dashboard.yaml", "files/dashboard.json"),
    ],
)
def test_chart_templates_ship_the_generated_files(template: str, generated: str) -> None:
    text = (CHART / "templates" / template).read_text()
    assert f'.Files.Get "{generated}"' in text


def test_every_alert_is_documented_and_unique() -> None:
    names = [alert.name for alert in alerts.ALERTS]
    assert len(set(names)) == len(names)
    for alert in alerts.ALERTS:
        assert alert.name.startswith("Batchpilot")
        assert alert.summary
        assert alert.description
        assert len(alert.runbook) >= 2, alert.name
    guide = (REPO / "docs" / "how-to" / "alerts-and-dashboard.md").read_text()
    missing = [name for name in names if f"`{name}`" not in guide]
    assert not missing, f"the alerts guide's list lacks {missing}"


def exported_names() -> set[str]:
    ours = {
        value
        for name, value in vars(telemetry).items()
        if name.isupper() and isinstance(value, str) and value.startswith("batchpilot_")
    }
    sidecar = {
        sidecar_telemetry.exported_name(family) for family in sidecar_telemetry.FAMILIES.values()
    }
    return ours | sidecar


def metric_names(expr: str) -> set[str]:
    found = set(re.findall(r"\bbatchpilot_[a-z0-9_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in found}


def all_queries() -> list[str]:
    panels = [query.expr for panel in dashboards.PANELS for query in panel.queries]
    return [alert.expr for alert in alerts.ALERTS] + panels


def test_every_metric_queried_is_exported() -> None:
    known = exported_names()
    for expr in all_queries():
        unknown = metric_names(expr) - known
        assert not unknown, f"{unknown} in {expr}"


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    checked = subprocess.run(
        [promtool, "check", "rules", str(CHART / "files" / "alerts.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts.ALERTS)} rules found" in checked.stdout


@pytest.mark.timeout(60)
def test_alert_rules_pass_their_promtool_unit_tests(promtool: str) -> None:
    tested = subprocess.run(
        [promtool, "test", "rules", str(ALERT_TESTS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {alert.name for alert in alerts.ALERTS}
    assert names - firing == set(), "never shown firing"
    assert names - silent == set(), "never shown silent"


def test_grafana_alert_rules_mirror_the_prometheus_rules() -> None:
    grafana = yaml.safe_load((CHART / "files" / "grafana-alerts.yaml").read_text())
    prometheus = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    (group,) = grafana["groups"]
    (rules_group,) = prometheus["groups"]
    by_title = {rule["title"]: rule for rule in group["rules"]}
    assert list(by_title) == [rule["alert"] for rule in rules_group["rules"]]
    for rule in rules_group["rules"]:
        mirrored = by_title[rule["alert"]]
        (query,) = [step for step in mirrored["data"] if step["refId"] == "A"]
        assert query["model"]["expr"] == rule["expr"]
        assert mirrored["for"] == rule.get("for", "0s")
        assert mirrored["labels"] == rule["labels"]
        assert mirrored["annotations"]["runbook"] == rule["annotations"]["runbook"]
        assert "$value " not in mirrored["annotations"]["description"]
        assert len(mirrored["uid"]) <= 40


def test_grafana_alert_rules_link_to_a_panel_of_the_dashboard() -> None:
    grafana = yaml.safe_load((CHART / "files" / "grafana-alerts.yaml").read_text())
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    panels = {str(panel["id"]): panel["title"] for panel in dashboard["panels"]}
    expected = {alert.name: alert.panel for alert in alerts.ALERTS}
    for rule in grafana["groups"][0]["rules"]:
        annotations = rule["annotations"]
        # Grafana refuses one without the other (and stops provisioning altogether).
        assert annotations["__dashboardUid__"] == dashboard["uid"]
        assert panels[annotations["__panelId__"]] == expected[rule["title"]]


def test_chart_scrapes_with_the_jobs_the_alerts_expect() -> None:
    templates = CHART / "templates"
    service_monitor = (templates / "servicemonitor.yaml").read_text()
    assert f"replacement: {queries.OPERATOR_JOB}" in service_monitor
    pod_monitor = (templates / "podmonitor-sidecars.yaml").read_text()
    assert f"replacement: {queries.SIDECAR_JOB}" in pod_monitor


def test_rules_and_panels_over_policy_series_keep_the_policy_s_namespace() -> None:
    """Aggregating policies by name alone would merge like-named policies of two namespaces."""
    for alert in alerts.ALERTS:
        if metric_names(alert.expr) & exported_names():
            assert f"{telemetry.POLICY_NAMESPACE}, {telemetry.POLICY}" in alert.expr, alert.name
            assert telemetry.POLICY_NAMESPACE in alert.summary, alert.name
    operator_series = [
        query
        for panel in dashboards.PANELS
        for query in panel.queries
        if any(not name.startswith("batchpilot_sidecar_") for name in metric_names(query.expr))
    ]
    assert operator_series
    for query in operator_series:
        assert f'{telemetry.POLICY_NAMESPACE}=~"$namespace"' in query.expr, query.expr
        assert telemetry.POLICY_NAMESPACE in query.legend, query.legend
