"""A real Grafana server for the dashboard and alert tests, built from its Go module.

No registry these machines reach ships Grafana as a program (Debian dropped it, PyPI and npm
carry only clients and front-end libraries), so ``python -m batchpilot_cluster.grafana build``
(``make
grafana``) builds the server the way ``batchpilot_cluster`` builds Kubernetes: once per pinned
version,
into ``${BATCHPILOT_CACHE:-~/.cache/batchpilot}``. The web front end is not built; the server
alone serves the HTTP API, provisioning and alert evaluation, which is what the tests use.
"""
