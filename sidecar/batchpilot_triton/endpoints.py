"""Where Triton and the batchpilot processes listen, and how their addresses are written.

Every default port is declared once, here: the CRD's `spec.target.sidecarPort` default, the
sidecar's `--listen`, the chart and the test fleets all take theirs from these names.
"""

from __future__ import annotations

from urllib.parse import urlsplit

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
    if not separator or not port.isdigit() or not 0 < int(port) < 65536:
        hint = f", e.g. {example}" if example else ""
        raise ValueError(f"{option} {text!r}: expected HOST:PORT{hint}")
    return host.strip("[]") or EVERY_ADDRESS, int(port)


def host_port(url: str) -> str:
    """`host:port` of an HTTP endpoint given with or without a scheme (tritonclient's form)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"Triton URL {url!r} needs a host and a port, e.g. http://10.0.0.5:8000")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def default_metrics_url(url: str, port: int = TRITON_METRICS_PORT) -> str:
    """Triton's metrics endpoint on the same host as its HTTP endpoint, on its default port."""
    host = host_port(url).rsplit(":", 1)[0]
    return f"http://{host}:{port}/metrics"
