"""Where Triton and the batchpilot processes listen, and how their addresses are written.

Every default port is declared once, here: the CRD's `spec.target.sidecarPort` default, the
sidecar's `--listen`, the chart and the test fleets all take theirs from these names.
"""

from __future__ import annotations

TRITON_HTTP_PORT = 8000
TRITON_GRPC_PORT = 8001
TRITON_METRICS_PORT = 8002
SIDECAR_PORT = 9400
"""The sidecar's /metrics, /status and /healthz."""
RUNNER_METRICS_PORT = 9401
"""The standalone runner's /metrics and /healthz."""
OPERATOR_METRICS_PORT = 9402
"""The operator's /metrics."""
EVERY_ADDRESS = "0.0.0.0"  # noqa: S104 - servers in Pods are reached from outside them


def parse_listen(text: str, *, option: str = "--listen", example: str = "") -> tuple[str, int]:
    """`HOST:PORT` to serve on; an empty host (`:9400`) means every address."""
    host, separator, port = text.rpartition(":")
    if not separator or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        hint = f", e.g. {example}" if example else ""
        raise ValueError(f"{option} {text!r}: expected HOST:PORT{hint}")
    return host.strip("[]") or EVERY_ADDRESS, int(port)
