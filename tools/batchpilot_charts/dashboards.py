"""The Grafana dashboard: every panel and its queries, in one table.

`PANELS` is the dashboard's source: `dashboard()` builds Grafana's JSON model from it, and the
README's picture (tests/dashboard_plots.py) draws the same queries from a real Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from batchpilot import telemetry
from batchpilot_charts import queries

DASHBOARD_UID = "batchpilot"
DASHBOARD_TITLE = "batchpilot: Triton dynamic batching"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, kw_only=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str
    """Grafana's unit id: s, µs, reqps, percentunit, bytes, short."""
    kind: Literal["timeseries", "state-timeline"] = "timeseries"


# One namespace variable serves both kinds of series: a policy governs the Triton Pods of its own
# namespace, which the operator's series name by policy_namespace and the sidecars' series, as
# scraped from those Pods, by namespace.
POLICY = f'{telemetry.POLICY_NAMESPACE}=~"$namespace", {telemetry.POLICY}=~"$policy"'
BY_POLICY = f"{telemetry.POLICY_NAMESPACE}, {telemetry.POLICY}"
NAMED = f"{{{{{telemetry.POLICY_NAMESPACE}}}}}/{{{{{telemetry.POLICY}}}}}"
"""A policy in a legend: namespace/name."""
TRITON = 'namespace=~"$namespace", model=~"$model"'
GPU = 'namespace=~"$namespace"'

PANELS: tuple[Panel, ...] = (
    Panel(
        title="Active profile",
        description="The profile in force for each policy (namespace/name), over time.",
        kind="state-timeline",
        queries=(
            Query(
                f"max by ({BY_POLICY}, profile) ({telemetry.ACTIVE_PROFILE}{{{POLICY}}})",
                f"{NAMED} {{{{profile}}}}",
            ),
        ),
        unit="short",
    ),
    Panel(
        title="p95 latency against the objective",
        description=(
            "Triton's p95 request latency per pod and model (sidecar), the fleet's p95 the "
            "last decision saw, and the objective in force (spec.slo.p95LatencyMs)."
        ),
        queries=(
            Query(
                f"max by (namespace, pod, model) "
                f'({queries.sidecar("request_latency_seconds")}{{quantile="0.95", {TRITON}}})',
                "{{pod}} {{model}}",
            ),
            Query(
                f"max by ({BY_POLICY}) ({queries.signal('p95LatencyMs', POLICY)}) / 1000",
                f"{NAMED} fleet",
            ),
            Query(
                f"max by ({BY_POLICY}) ({telemetry.SLO_P95_LATENCY}{{{POLICY}}})",
                f"{NAMED} objective",
            ),
        ),
        unit="s",
    ),
    Panel(
        title="Request rate",
        description="Requests per second per model, summed over the pods (sidecar).",
        queries=(
            Query(
                f"sum by (namespace, model) ({queries.sidecar('requests_per_second')}{{{TRITON}}})",
                "{{namespace}} {{model}}",
            ),
        ),
        unit="reqps",
    ),
    Panel(
        title="Average batch size",
        description="Inferences per execution per model, over all pods (sidecar).",
        queries=(
            Query(
                f"sum by (namespace, model) "
                f"({queries.sidecar('inferences_per_second')}{{{TRITON}}})\n"
                f"/ sum by (namespace, model) "
                f"({queries.sidecar('executions_per_second')}{{{TRITON}}})",
                "{{namespace}} {{model}}",
            ),
        ),
        unit="short",
    ),
    Panel(
        title="Queue delay in force",
        description=(
            "max_queue_delay_microseconds of the settings in force (after SLO autotune), and "
            "the time requests really waited in Triton's queue (sidecar)."
        ),
        queries=(
            Query(
                f"max by ({BY_POLICY}) ({telemetry.QUEUE_DELAY}{{{POLICY}}})",
                f"{NAMED} max queue delay",
            ),
            Query(
                f"1e6 * avg by (namespace, model) "
                f"({queries.sidecar('queue_seconds_per_request')}{{{TRITON}}})",
                "{{namespace}} {{model}} queue wait",
            ),
        ),
        unit="µs",
    ),
    Panel(
        title="GPU utilization",
        description="Fraction of time a kernel ran, per GPU (sidecar: NVML or DCGM).",
        queries=(
            Query(
                f"max by (namespace, pod, gpu) "
                f"({queries.sidecar('gpu_utilization_ratio')}{{{GPU}}})",
                "{{pod}} GPU {{gpu}}",
            ),
        ),
        unit="percentunit",
    ),
    Panel(
        title="GPU memory",
        description="GPU memory in use and in all, per GPU (sidecar).",
        queries=(
            Query(
                f"max by (namespace, pod, gpu) "
                f"({queries.sidecar('gpu_memory_used_bytes')}{{{GPU}}})",
                "{{pod}} GPU {{gpu}} used",
            ),
            Query(
                f"max by (namespace, pod, gpu) "
                f"({queries.sidecar('gpu_memory_total_bytes')}{{{GPU}}})",
                "{{pod}} GPU {{gpu}} total",
            ),
        ),
        unit="bytes",
    ),
    Panel(
        title="Profile switches",
        description="Switches decided, by the profile switched to.",
        queries=(
            Query(
                f"sum by ({BY_POLICY}, profile) "
                f"(increase({telemetry.PROFILE_SWITCHES}{{{POLICY}}}[$__rate_interval]))",
                f"{NAMED} to {{{{profile}}}}",
            ),
        ),
        unit="short",
    ),
    Panel(
        title="Apply latency",
        description="Time to apply a profile to one model on one server (reloads only).",
        queries=(
            Query(
                f"histogram_quantile(0.95, sum by ({BY_POLICY}, le) "
                f"(rate({telemetry.APPLY_DURATION}_bucket{{{POLICY}}}[$__rate_interval])))",
                f"{NAMED} p95",
            ),
            Query(
                f"sum by ({BY_POLICY}) (rate({telemetry.APPLY_DURATION}_sum{{{POLICY}}}"
                f"[$__rate_interval]))\n/ sum by ({BY_POLICY}) "
                f"(rate({telemetry.APPLY_DURATION}_count{{{POLICY}}}[$__rate_interval]))",
                f"{NAMED} mean",
            ),
        ),
        unit="s",
    ),
    Panel(
        title="Targets",
        description="Governed Triton servers by state (updated, pending, failed, unreachable).",
        queries=(
            Query(
                f"max by ({BY_POLICY}, state) ({telemetry.TARGETS}{{{POLICY}}})",
                f"{NAMED} {{{{state}}}}",
            ),
        ),
        unit="short",
    ),
)


def panel_id(title: str) -> int:
    """The id of the panel with this title in the dashboard's JSON (alerts link to it)."""
    for index, panel in enumerate(PANELS):
        if panel.title == title:
            return index + 1
    raise KeyError(f"no dashboard panel is titled {title!r}")


_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_WIDTH, _HEIGHT = 12, 8


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": _DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def _panel_json(panel: Panel, index: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom"}}
    if panel.kind == "state-timeline":
        # One row per policy and profile, lit while the profile is in force.
        defaults["mappings"] = [
            {
                "type": "value",
                "options": {
                    "0": {"text": " ", "color": "transparent"},
                    "1": {"text": "in force", "color": "green"},
                },
            }
        ]
        defaults["color"] = {"mode": "fixed", "fixedColor": "transparent"}
        options.update({"showValue": "never", "mergeValues": True, "rowHeight": 0.8})
    else:
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        options["tooltip"] = {"mode": "multi", "sort": "desc"}
    return {
        "id": panel_id(panel.title),
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": _DATASOURCE,
        "gridPos": {
            "h": _HEIGHT,
            "w": _WIDTH,
            "x": (index % 2) * _WIDTH,
            "y": (index // 2) * _HEIGHT,
        },
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + number),
                "datasource": _DATASOURCE,
                "expr": query.expr,
                "legendFormat": query.legend,
                "range": True,
            }
            for number, query in enumerate(panel.queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard (JSON model), with data source, namespace, policy and model
    variables: the policies and models on offer are those of the namespaces chosen."""
    requests = queries.sidecar("requests_per_second")
    return {
        "uid": DASHBOARD_UID,
        # Not "batchpilot": Grafana refuses a dashboard named like its folder, and the alert
        # rules live in the folder "batchpilot" (rendering.GRAFANA_FOLDER).
        "title": DASHBOARD_TITLE,
        "description": "Policy-driven dynamic batching for Triton: profiles, latency, batching.",
        "tags": ["batchpilot", "triton"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                _variable(
                    "namespace",
                    "Namespace",
                    f"label_values({telemetry.ACTIVE_PROFILE}, {telemetry.POLICY_NAMESPACE})",
                ),
                _variable(
                    "policy",
                    "Policy",
                    f"label_values({telemetry.ACTIVE_PROFILE}"
                    f'{{{telemetry.POLICY_NAMESPACE}=~"$namespace"}}, {telemetry.POLICY})',
                ),
                _variable(
                    "model", "Model", f'label_values({requests}{{namespace=~"$namespace"}}, model)'
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": [_panel_json(panel, index) for index, panel in enumerate(PANELS)],
    }


def instantiate(expr: str, *, rate_interval: str = "1m") -> str:
    """A panel query as Prometheus runs it with every variable at All."""
    return (
        expr.replace('=~"$policy"', '=~".*"')
        .replace('=~"$namespace"', '=~".*"')
        .replace('=~"$model"', '=~".*"')
        .replace("$__rate_interval", rate_interval)
    )
