"""The alerts and the dashboard: every alert rule and every panel, in one place.

Prometheus, Grafana alerting and the Grafana dashboard all take their rules and queries from the
tables here, so a threshold or a query changes in one place and the three cannot disagree.
`python -m batchpilot.observability` writes what the Helm chart ships: `files/alerts.yaml`
(plain Prometheus rule groups, which promtool checks and tests and the PrometheusRule template
wraps), `files/grafana-alerts.yaml` (Grafana's file-provisioning format), `files/dashboard.json`,
and the chart's copy of `crds/`. A unit test fails when any of them is stale.

Metric names come from the modules that export them (`batchpilot.telemetry` for the operator
and the runner, `batchpilot_sidecar.telemetry` for the sidecar), never retyped here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from batchpilot import telemetry
from batchpilot.policy import specs
from batchpilot_sidecar import telemetry as sidecar_telemetry

OPERATOR_JOB = "batchpilot-operator"
"""The operator's scrape job: the chart's ServiceMonitor sets it; plain setups name it so."""
SIDECAR_JOB = "batchpilot-sidecar"
"""The sidecars' scrape job: the chart's PodMonitor sets it."""
RULE_GROUP = "batchpilot"
GRAFANA_FOLDER = "batchpilot"
GRAFANA_DATASOURCE_UID = "prometheus"
"""The data source the Grafana alert rules query: kube-prometheus-stack's default uid; the chart
replaces it with `grafana.alerts.datasourceUid`."""
DASHBOARD_UID = "batchpilot"

Severity = Literal["critical", "warning", "info"]


@dataclass(frozen=True, kw_only=True)
class Alert:
    name: str
    expr: str
    for_: str | None
    """How long the expression must hold before the alert fires; None fires at once."""
    severity: Severity
    summary: str
    description: str
    runbook: tuple[str, ...]
    """What to check, step by step."""

    def runbook_text(self) -> str:
        return "\n".join(f"{number}. {step}" for number, step in enumerate(self.runbook, 1))


def _signal(metric: specs.LoadMetric, *matchers: str) -> str:
    selector = ", ".join((f'metric="{metric}"', *matchers))
    return f"{telemetry.SIGNAL}{{{selector}}}"


def _by_policy(selector: str) -> str:
    # The operator's series carry the scrape labels of its pod, and replicas report the same
    # policies: rules aggregate the pods away and keep the namespace and the policy.
    return f"max by (namespace, policy) ({selector})"


_ACTIVE = f"{telemetry.ACTIVE_PROFILE} == 1"
_IN_BULK = f'{telemetry.ACTIVE_PROFILE}{{profile="bulk"}} == 1'
_SIGNALS_MISSING = f"{telemetry.SIGNALS_UNAVAILABLE} == 1"

ALERTS: tuple[Alert, ...] = (
    Alert(
        name="BatchpilotSloBreached",
        # A stale latency reading (signals missing) is that alert's business, not this one's.
        # The profile label comes from the profile in force (topk: one, even if a replica that
        # lost the lead still reports another).
        expr=(
            f"(\n  {_by_policy(_signal('p95LatencyMs'))} / 1000\n"
            f"  > on (namespace, policy) {_by_policy(telemetry.SLO_P95_LATENCY)}\n"
            f"  unless on (namespace, policy) {_by_policy(_SIGNALS_MISSING)}\n)\n"
            f"* on (namespace, policy) group_left (profile) topk by (namespace, policy) (\n"
            f"  1, max by (namespace, policy, profile) ({_ACTIVE})\n)"
        ),
        for_="10m",
        severity="critical",
        summary="{{ $labels.policy }} misses its p95 latency objective in {{ $labels.profile }}",
        description=(
            "The fleet of policy {{ $labels.policy }} has answered with a p95 latency of "
            "{{ $value | humanizeDuration }} for 10 minutes, above spec.slo.p95LatencyMs, while "
            "{{ $labels.profile }} (a profile the objective governs, typically interactive) is "
            "in force."
        ),
        runbook=(
            "`kubectl describe bp <policy>`: status.reason says why the profile is in force; a "
            "True SignalsUnavailable condition puts the latency reading itself in doubt.",
            "On the dashboard, compare the queue delay in force with the measured queue wait "
            "and the request rate. With slo.autotune the delay follows the sidecar's "
            "recommendation: `curl http://<pod-ip>:9400/status?sloP95Ms=<objective>` shows it "
            "and the fitted step time.",
            "A queue wait near zero with a high latency means the model is compute-bound: "
            "scale the Triton Deployment, or lower the profile's maxBatchSize and "
            "preferredBatchSizes.",
            "For immediate relief, set spec.override to a lower-latency profile with an `until`.",
        ),
    ),
    Alert(
        name="BatchpilotApplyFailures",
        # Controllers export these counters from zero, so `increase` sees the first failure.
        expr=f"sum by (namespace, policy, reason) (increase({telemetry.APPLY_ERRORS}[15m])) > 0",
        for_=None,
        severity="warning",
        summary="Applying a profile of {{ $labels.policy }} failed ({{ $labels.reason }})",
        description=(
            "batchpilot failed to apply a profile of policy {{ $labels.policy }} to a Triton "
            "server in the last 15 minutes (reason {{ $labels.reason }}). A configuration "
            "Triton rejects is rolled back to the previous one, so the server keeps serving."
        ),
        runbook=(
            "`kubectl get events --field-selector reason=ApplyFailed` (and reason=RolledBack) "
            "names the pod and quotes Triton's error.",
            "explicit_mode_required: start tritonserver with --model-control-mode=explicit. "
            "refused: the profile asks for more than the model allows (a maxBatchSize above "
            "the model's own, preferred sizes above the cap); fix the profile. "
            "rejected, RolledBack: Triton refused the configuration; its log says why. "
            "rollback_failed: the model may be unloaded; check "
            "`curl http://<pod-ip>:8000/v2/models/<model>/ready` and load it again.",
            "batchpilot retries on every tick; the alert clears 15 minutes after the last failure.",
        ),
    ),
    Alert(
        name="BatchpilotProfileFlapping",
        expr=f"sum by (namespace, policy) (increase({telemetry.PROFILE_SWITCHES}[1h])) > 6",
        for_=None,
        severity="warning",
        summary="{{ $labels.policy }} switched profiles {{ $value | humanize }} times in an hour",
        description=(
            "Policy {{ $labels.policy }} switched profiles more than 6 times in the last hour. "
            "Every switch reloads the model on every replica, which drains or stalls it."
        ),
        runbook=(
            "The ProfileSwitched events (`kubectl get events --field-selector "
            "reason=ProfileSwitched`) show which rule keeps flipping.",
            "For a load rule, widen its hysteresis (a `below` well under `above`) and lengthen "
            "its `for`.",
            "Raise spec.minDwellSeconds: no switch happens before the profile in force has "
            "lasted that long (overrides excepted).",
        ),
    ),
    Alert(
        name="BatchpilotTargetsFailed",
        expr=(
            "max by (namespace, policy, state) "
            f'({telemetry.TARGETS}{{state=~"failed|unreachable"}}) > 0'
        ),
        for_="5m",
        severity="warning",
        summary="{{ $value }} targets of {{ $labels.policy }} are {{ $labels.state }}",
        description=(
            "{{ $value }} Triton servers governed by policy {{ $labels.policy }} have been "
            "{{ $labels.state }} for 5 minutes and do not run the decided profile."
        ),
        runbook=(
            "`kubectl describe bp <policy>`: the Degraded condition and status.targets name "
            "each failing pod and its error.",
            "unreachable: is the pod Running with an IP, and does Triton answer on the target "
            "port (`curl http://<pod-ip>:8000/v2/health/ready`)? NetworkPolicies must let the "
            "operator in.",
            "failed: BatchpilotApplyFailures gives the reason.",
        ),
    ),
    Alert(
        name="BatchpilotTargetsDrifted",
        expr=f'max by (namespace, policy) ({telemetry.TARGETS}{{state="pending"}}) > 0',
        for_="15m",
        severity="warning",
        summary="{{ $value }} targets of {{ $labels.policy }} lag behind the decided profile",
        description=(
            "{{ $value }} Triton servers of policy {{ $labels.policy }} have not run the decided "
            "profile for 15 minutes: the rollout halted after rollout.maxUnavailable failures "
            "and left them on their previous configuration."
        ),
        runbook=(
            "Fix the failing targets first (BatchpilotTargetsFailed): a rollout stops once "
            "maxUnavailable replicas fail, and goes on at the next tick after they recover.",
            "`kubectl describe bp <policy>`: the Progressing condition says RolloutPending and "
            "status.targets lists the pending pods.",
        ),
    ),
    Alert(
        name="BatchpilotOperatorDown",
        expr=f'absent(up{{job="{OPERATOR_JOB}"}} == 1)',
        for_="5m",
        severity="critical",
        summary="No batchpilot operator is up",
        description=(
            f"Prometheus has scraped no running batchpilot operator (job {OPERATOR_JOB}) for 5 "
            "minutes. Triton servers keep their configuration, but no schedule, load rule or "
            "override takes effect and no drift is repaired."
        ),
        runbook=(
            "`kubectl -n batchpilot-system get pods,events`: crash loops, image pulls, scheduling.",
            "`kubectl -n batchpilot-system logs deploy/batchpilot-operator`: API errors name a "
            "missing permission or CRD.",
            "If the operator runs but is not scraped: the ServiceMonitor must match the "
            "metrics Service and be selected by your Prometheus (serviceMonitor.labels); "
            f"other scrape setups must name the job {OPERATOR_JOB}.",
        ),
    ),
    Alert(
        name="BatchpilotSignalsUnavailable",
        expr=_by_policy(_SIGNALS_MISSING),
        for_="10m",
        severity="warning",
        summary="{{ $labels.policy }} decides without its load signals",
        description=(
            "For 10 minutes the decisions of policy {{ $labels.policy }} have lacked a load "
            "signal its rules need: the sidecars or Prometheus did not answer, or did not "
            "measure it. Load rules keep their last state for a grace period, then the "
            "schedule decides; SLO autotune keeps the last tuned delay."
        ),
        runbook=(
            "`kubectl describe bp <policy>`: the SignalsUnavailable condition lists each "
            "problem (which sidecar, which query).",
            "spec.load.source sidecar: is the sidecar container running, and does "
            "`curl http://<pod-ip>:9400/status` answer? It reports the health of each of its "
            "sources (Triton's metrics, its statistics, the GPU).",
            "spec.load.source prometheus: check spec.load.prometheus.url from the operator's "
            "namespace.",
            "p95LatencyMs needs tritonserver's --metrics-config summary_latencies=true.",
        ),
    ),
    Alert(
        name="BatchpilotGpuUnderusedInBulk",
        expr=(
            f"{_by_policy(_signal('gpuUtilization'))} < 30\n"
            f"and on (namespace, policy)\n{_by_policy(_IN_BULK)}"
        ),
        for_="30m",
        severity="info",
        summary="{{ $labels.policy }} runs bulk with its GPUs {{ $value | humanize }}% busy",
        description=(
            "Policy {{ $labels.policy }} has been in its bulk profile for 30 minutes while its "
            "GPUs were less than 30% busy: requests wait for big batches the load does not "
            "fill, paying latency for efficiency nobody needs."
        ),
        runbook=(
            "Compare the request rate with the average batch size on the dashboard: at this "
            "rate a shorter queue delay makes the same batches.",
            "Enable spec.slo.autotune for the bulk profile, or lower its "
            "maxQueueDelayMicroseconds.",
            "If the schedule decides bulk, add a load rule that keeps the interactive profile "
            "while the rate is low. (The rule matches the profile named bulk; copy it for "
            "other names.)",
        ),
    ),
)


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


def _sidecar(name: str) -> str:
    return sidecar_telemetry.exported_name(sidecar_telemetry.FAMILIES[name])


POLICY = 'policy=~"$policy"'
TRITON = 'namespace=~"$namespace", model=~"$model"'
GPU = 'namespace=~"$namespace"'

PANELS: tuple[Panel, ...] = (
    Panel(
        title="Active profile",
        description="The profile in force for each policy, over time.",
        kind="state-timeline",
        queries=(
            Query(
                f"max by (policy, profile) ({telemetry.ACTIVE_PROFILE}{{{POLICY}}})",
                "{{policy}} {{profile}}",
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
                f'({_sidecar("request_latency_seconds")}{{quantile="0.95", {TRITON}}})',
                "{{pod}} {{model}}",
            ),
            Query(f"{_signal('p95LatencyMs', POLICY)} / 1000", "{{policy}} fleet"),
            Query(f"{telemetry.SLO_P95_LATENCY}{{{POLICY}}}", "{{policy}} objective"),
        ),
        unit="s",
    ),
    Panel(
        title="Request rate",
        description="Requests per second per model, summed over the pods (sidecar).",
        queries=(
            Query(
                f"sum by (namespace, model) ({_sidecar('requests_per_second')}{{{TRITON}}})",
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
                f"sum by (namespace, model) ({_sidecar('inferences_per_second')}{{{TRITON}}})\n"
                f"/ sum by (namespace, model) ({_sidecar('executions_per_second')}{{{TRITON}}})",
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
            Query(f"{telemetry.QUEUE_DELAY}{{{POLICY}}}", "{{policy}} max queue delay"),
            Query(
                f"1e6 * avg by (namespace, model) "
                f"({_sidecar('queue_seconds_per_request')}{{{TRITON}}})",
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
                f"max by (namespace, pod, gpu) ({_sidecar('gpu_utilization_ratio')}{{{GPU}}})",
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
                f"max by (namespace, pod, gpu) ({_sidecar('gpu_memory_used_bytes')}{{{GPU}}})",
                "{{pod}} GPU {{gpu}} used",
            ),
            Query(
                f"max by (namespace, pod, gpu) ({_sidecar('gpu_memory_total_bytes')}{{{GPU}}})",
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
                f"sum by (policy, profile) "
                f"(increase({telemetry.PROFILE_SWITCHES}{{{POLICY}}}[$__rate_interval]))",
                "{{policy}} to {{profile}}",
            ),
        ),
        unit="short",
    ),
    Panel(
        title="Apply latency",
        description="Time to apply a profile to one model on one server (reloads only).",
        queries=(
            Query(
                f"histogram_quantile(0.95, sum by (policy, le) "
                f"(rate({telemetry.APPLY_DURATION}_bucket{{{POLICY}}}[$__rate_interval])))",
                "{{policy}} p95",
            ),
            Query(
                f"sum by (policy) (rate({telemetry.APPLY_DURATION}_sum{{{POLICY}}}"
                f"[$__rate_interval]))\n/ sum by (policy) "
                f"(rate({telemetry.APPLY_DURATION}_count{{{POLICY}}}[$__rate_interval]))",
                "{{policy}} mean",
            ),
        ),
        unit="s",
    ),
    Panel(
        title="Targets",
        description="Governed Triton servers by state (updated, pending, failed, unreachable).",
        queries=(
            Query(
                f"max by (policy, state) ({telemetry.TARGETS}{{{POLICY}}})",
                "{{policy}} {{state}}",
            ),
        ),
        unit="short",
    ),
)


def prometheus_rules() -> dict[str, Any]:
    """Plain Prometheus rule groups (what `promtool check rules` reads)."""
    rules = []
    for alert in ALERTS:
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
    for alert in ALERTS:
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
                    "__dashboardUid__": DASHBOARD_UID,
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
        "id": index + 1,
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
    """The Grafana dashboard (JSON model), with data source, policy, namespace and model
    variables."""
    requests = _sidecar("requests_per_second")
    return {
        "uid": DASHBOARD_UID,
        "title": "batchpilot",
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
                _variable("policy", "Policy", f"label_values({telemetry.ACTIVE_PROFILE}, policy)"),
                _variable("namespace", "Namespace", f"label_values({requests}, namespace)"),
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


class _Dumper(yaml.SafeDumper):
    """Block scalars for multi-line strings, so expressions and runbooks read as written."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)

HEADER = "# Generated by `python -m batchpilot.observability`; do not edit.\n"


def _yaml(document: Mapping[str, Any]) -> str:
    return HEADER + yaml.dump(
        document, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True
    )


REPOSITORY = Path(__file__).resolve().parents[2]
"""The source checkout this module lives in."""


def rendered(repository: Path) -> dict[Path, str]:
    """Every generated file of the chart, by path, as it should read."""
    chart = repository / "charts" / "batchpilot"
    files = {
        chart / "files" / "alerts.yaml": _yaml(prometheus_rules()),
        chart / "files" / "grafana-alerts.yaml": _yaml(grafana_alert_rules()),
        chart / "files" / "dashboard.json": json.dumps(dashboard(), indent=2, ensure_ascii=False)
        + "\n",
    }
    for crd in sorted((repository / "crds").glob("*.yaml")):
        files[chart / "crds" / crd.name] = crd.read_text(encoding="utf-8")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repository",
        type=Path,
        default=REPOSITORY,
        help="the batchpilot checkout (default: the one this module is in)",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is stale"
    )
    arguments = parser.parse_args(argv)
    files = rendered(arguments.repository)
    stale = []
    for leftover in (arguments.repository / "charts" / "batchpilot" / "crds").glob("*"):
        if leftover not in files:  # a CRD removed from crds/
            stale.append(leftover)
            if not arguments.check:
                leftover.unlink()
    for path, text in files.items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not arguments.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'stale' if arguments.check else 'wrote'}: {path}", file=sys.stderr)
    return 1 if stale and arguments.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
