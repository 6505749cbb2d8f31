"""What the Helm chart ships that is generated, and the one generator of the repository.

- `queries`: the series alerts and panels query, by the names their exporters give them;
- `alerts`: every alert rule, with its summary, description and runbook;
- `dashboards`: every panel of the Grafana dashboard and its queries;
- `rendering`: the formats the chart ships them in (Prometheus rule groups, Grafana's
  provisioning format, YAML as written);
- `manifests`: the plain install and RBAC manifests, rendered from the chart by `helm template`;
- `generating`: `make generate` (`python -m batchpilot_charts`), which writes every generated
  file (the CRD, the chart's copy of `crds/`, the chart's `files/`, the plain manifests) or, with
  `--check`, names the stale ones.

Metric names come from the modules that export them (`batchpilot.telemetry` for the operator and
the runner, `batchpilot_sidecar.telemetry` for the sidecar), never retyped here: this package may
import both programs, and neither imports it. It is a development tool: the images do not carry
it.
"""
