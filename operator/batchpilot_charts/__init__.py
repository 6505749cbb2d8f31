"""What the Helm chart ships that is generated, and the generator that writes it.

- `queries`: the series alerts and panels query, by the names their exporters give them;
- `alerts`: every alert rule, with its summary, description and runbook;
- `dashboards`: every panel of the Grafana dashboard and its queries;
- `rendering`: the formats the chart ships them in (Prometheus rule groups, Grafana's
  provisioning format, YAML as written);
- `generating`: `python -m batchpilot_charts`, which writes the chart's generated files or, with
  `--check`, names the stale ones.

Metric names come from the modules that export them (`batchpilot.telemetry` for the operator and
the runner, `batchpilot_sidecar.telemetry` for the sidecar), never retyped here: this package may
import both programs, and neither imports it.
"""
