"""What alerts and panels query: the series, named as their exporters name them, and the jobs.

The operator's and the runner's names come from `batchpilot.telemetry`, the sidecar's from
`batchpilot_sidecar.telemetry`, so a renamed metric breaks the queries at import, not in Grafana.
"""

from __future__ import annotations

from batchpilot import telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot_sidecar import telemetry as sidecar_telemetry

OPERATOR_JOB = "batchpilot-operator"
"""The operator's scrape job: the chart's ServiceMonitor sets it; plain setups name it so."""
SIDECAR_JOB = "batchpilot-sidecar"
"""The sidecars' scrape job: the chart's PodMonitor sets it."""


def signal(metric: specs.LoadMetric, *matchers: str) -> str:
    """A load signal the last decision saw, as the controllers export it."""
    selector = ", ".join((f'metric="{metric}"', *matchers))
    return f"{telemetry.SIGNAL}{{{selector}}}"


def sidecar(name: str) -> str:
    """The exported name of one of the sidecar's families (`requests_per_second`, ...)."""
    return sidecar_telemetry.exported_name(sidecar_telemetry.FAMILIES[name])


POLICY_LABELS = f"namespace, {telemetry.POLICY_NAMESPACE}, {telemetry.POLICY}"
"""What names a policy in rules: the scrape's namespace (the operator's own), the policy's
namespace and its name. Two policies of one name in two namespaces are two policies."""


def by_policy(selector: str) -> str:
    # The operator's series carry the scrape labels of its pod, and replicas report the same
    # policies: rules aggregate the pods away and keep what names the policy.
    return f"max by ({POLICY_LABELS}) ({selector})"
