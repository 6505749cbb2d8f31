"""The Prometheus metrics batchpilot exports about itself: every name, in one place.

The standalone runner and the operator export the same families, so one dashboard and one set
of alerts serve both. Names are documented in the README's metrics table.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PREFIX = "batchpilot"


@dataclass(frozen=True)
class ControllerMetrics:
    """What a controller (runner or operator) reports per policy."""

    registry: CollectorRegistry
    active_profile: Gauge
    switches: Counter
    decisions: Counter
    apply_seconds: Histogram
    apply_errors: Counter
    targets: Gauge
    signal: Gauge
    queue_delay: Gauge
    next_transition: Gauge


def controller_metrics(registry: CollectorRegistry | None = None) -> ControllerMetrics:
    registry = registry or CollectorRegistry()
    return ControllerMetrics(
        registry=registry,
        active_profile=Gauge(
            f"{PREFIX}_active_profile",
            "1 for the profile in force for a policy, 0 for its other profiles.",
            ["policy", "profile"],
            registry=registry,
        ),
        switches=Counter(
            f"{PREFIX}_profile_switches",
            "Profile switches decided, by the profile switched to.",
            ["policy", "profile"],
            registry=registry,
        ),
        decisions=Counter(
            f"{PREFIX}_decisions",
            "Decisions made, by what chose the profile (override, load, schedule, default).",
            ["policy", "source"],
            registry=registry,
        ),
        apply_seconds=Histogram(
            f"{PREFIX}_apply_duration_seconds",
            "Time to apply a profile to one model on one server, reloads only.",
            ["policy"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        ),
        apply_errors=Counter(
            f"{PREFIX}_apply_errors",
            "Failed applies, by reason (unreachable, refused, rejected, rollback_failed, "
            "explicit_mode_required, model_unavailable).",
            ["policy", "reason"],
            registry=registry,
        ),
        targets=Gauge(
            f"{PREFIX}_targets",
            "Governed Triton servers by state (updated, pending, failed, unreachable).",
            ["policy", "state"],
            registry=registry,
        ),
        signal=Gauge(
            f"{PREFIX}_signal",
            "The load signals the last decision saw, by metric name.",
            ["policy", "metric"],
            registry=registry,
        ),
        queue_delay=Gauge(
            f"{PREFIX}_queue_delay_microseconds",
            "max_queue_delay_microseconds of the settings in force (after SLO autotune).",
            ["policy"],
            registry=registry,
        ),
        next_transition=Gauge(
            f"{PREFIX}_next_transition_timestamp_seconds",
            "When the decision next changes by the clock (Unix time); 0 when none is due.",
            ["policy"],
            registry=registry,
        ),
    )


async def serve(registry: CollectorRegistry, *, host: str, port: int) -> web.AppRunner:
    """Serve `/metrics` and `/healthz` until the returned runner is cleaned up."""

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
