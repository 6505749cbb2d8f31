"""The metrics and alerts reference, from their one definition.

The operator's and the runner's families come from `batchpilot.telemetry` (the collectors
themselves, registered on a scratch registry), the sidecar's from
`batchpilot_sidecar.telemetry.FAMILIES`, the alerts from `batchpilot_charts.alerts.ALERTS`, which
the chart's Prometheus and Grafana rules are rendered from as well.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchpilot import telemetry
from batchpilot_charts import alerts
from batchpilot_docs import formats
from batchpilot_sidecar import telemetry as sidecar_telemetry


def _exported(family: Counter | Gauge | Histogram) -> str:
    (described,) = family.describe()
    suffix = {"counter": "_total", "histogram": "_bucket, _sum, _count"}.get(described.type, "")
    return described.name + (suffix if suffix == "_total" else f" ({suffix})" if suffix else "")


def _controller_rows() -> list[tuple[str, str, str, str]]:
    metrics = telemetry.controller_metrics(CollectorRegistry())
    rows = []
    for value in vars(metrics).values():
        if isinstance(value, Counter | Gauge | Histogram):
            (described,) = value.describe()
            # The label names are only kept privately; they are what the collector was built with.
            labels = ", ".join(value._labelnames)
            rows.append(
                (formats.code(_exported(value)), described.type, labels, described.documentation)
            )
    return rows


def _sidecar_rows() -> list[tuple[str, str, str, str]]:
    return [
        (
            formats.code(sidecar_telemetry.exported_name(family)),
            family.kind,
            ", ".join(family.labels),
            family.help,
        )
        for family in sidecar_telemetry.FAMILIES.values()
    ]


def metrics_page() -> str:
    """docs/reference/metrics.md."""
    columns = ("Name", "Type", "Labels", "What it measures")
    return (
        formats.header("batchpilot.telemetry and batchpilot_sidecar.telemetry")
        + f"""# Metrics

## The operator and the standalone runner

Both export the same families on `/metrics` (the operator on its metrics port, `batchpilot run`
on `--listen`), so one dashboard and one set of alerts serve both. Every series names its policy
by `{telemetry.POLICY_NAMESPACE}` and `{telemetry.POLICY}`, and leaves with the policy.

"""
        + formats.table(columns, _controller_rows())
        + """
## The sidecar

Each sidecar exports what it measured of its Triton server and GPUs on `/metrics`; a value that
was not measured is not exported. [Its endpoints](sidecar-endpoints.md) say more.

"""
        + formats.table(columns, _sidecar_rows())
    )


def _fires(alert: alerts.Alert) -> str:
    return f"after {alert.for_}" if alert.for_ else "at once"


def alerts_page() -> str:
    """docs/reference/alerts.md."""
    parts = [
        formats.header("batchpilot_charts.alerts"),
        "# Alerts\n",
        "The chart's PrometheusRule (`prometheusRule.enabled`) and its Grafana alert rules "
        "(`grafana.alerts.enabled`) carry these rules, rendered from one table. Texts in "
        "`{{ }}` are filled in by Prometheus or Grafana when the alert fires.\n",
        formats.table(
            ("Alert", "Severity", "Fires", "Summary"),
            [
                (
                    f"[`{alert.name}`](#{alert.name.lower()})",
                    alert.severity,
                    _fires(alert),
                    alert.summary,
                )
                for alert in alerts.ALERTS
            ],
        ),
    ]
    for alert in alerts.ALERTS:
        parts += [
            f"## `{alert.name}` {{#{alert.name.lower()}}}\n",
            f"{alert.description}\n",
            f"Severity {alert.severity}; fires {_fires(alert)}; "
            f"the dashboard panel to look at first: *{alert.panel}*.\n",
            "```promql",
            alert.expr,
            "```\n",
            "What to check:\n",
            "\n".join(f"{number}. {step}" for number, step in enumerate(alert.runbook, 1)) + "\n",
        ]
    return "\n".join(parts)
