"""The dashboard: the panels the issue asks for, laid out without overlap, in valid PromQL."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from batchpilot_charts import dashboards, formats

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "batchpilot" / "files" / "dashboard.json"


def test_dashboard_queries_are_valid_promql(tmp_path: Path, promtool: str) -> None:
    # promtool parses recording rules without a server: one rule per panel query.
    rules = [
        {"record": f"panel:{number}", "expr": dashboards.instantiate(expr)}
        for number, expr in enumerate(q.expr for p in dashboards.PANELS for q in p.queries)
    ]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    checked = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_dashboard_has_the_panels_the_issue_asks_for() -> None:
    titles = [panel["title"] for panel in dashboard()["panels"]]
    assert titles == [panel.title for panel in dashboards.PANELS]
    for wanted in (
        "Active profile",
        "p95 latency against the objective",
        "Request rate",
        "Average batch size",
        "Queue delay in force",
        "GPU utilization",
        "GPU memory",
        "Profile switches",
        "Apply latency",
    ):
        assert wanted in titles


def test_dashboard_panels_do_not_overlap_and_every_query_uses_the_chosen_source() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine
        assert grid["x"] + grid["w"] <= 24
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    variables = [variable["name"] for variable in dashboard()["templating"]["list"]]
    assert variables == ["datasource", "namespace", "policy", "model"]


def test_dashboard_is_not_named_like_the_folder_of_the_alert_rules() -> None:
    # Grafana refuses a dashboard titled like its folder, and the chart suggests putting the
    # dashboard beside the alert rules (grafana.dashboard.annotations: grafana_folder).
    assert dashboard()["title"] != formats.GRAFANA_FOLDER
    assert dashboard()["uid"] == dashboards.DASHBOARD_UID
