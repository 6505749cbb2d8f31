"""Every dashboard panel's queries return data from a real Prometheus scraping a real Triton's
sidecar and the standalone runner (tests/monitored_stacks.py) under a burst of load, and every
alert rule evaluates against those series without an error. With BATCHPILOT_DASHBOARD_PNG=path
(`make dashboard-png`) the test also draws the panels there, for the README.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import dashboard_plots
import monitored_stacks
from batchpilot_charts import alerts, dashboards
from prometheus_fixtures import StartPrometheus
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "charts" / "batchpilot" / "files" / "alerts.yaml"
PICTURE = "BATCHPILOT_DASHBOARD_PNG"
STEP = 1.0
"""Seconds between the points of the range queries (Prometheus scrapes every second)."""


def by_time(matrix: Sequence[Mapping[str, Any]]) -> dict[float, float]:
    """The finite points of a single-series matrix (or of its series taken together), by time."""
    points = {float(at): float(value) for series in matrix for at, value in series["values"]}
    return {at: value for at, value in points.items() if math.isfinite(value)}


def report_figures(results: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> None:
    """The figures the README quotes: rate, batch size and device load in each profile."""
    in_force = {
        float(at): series["metric"]["profile"]
        for series in results["Active profile"][0]
        for at, value in series["values"]
        if float(value) == 1
    }
    rate = by_time(results["Request rate"][0])
    batch = by_time(results["Average batch size"][0])
    busy = by_time(results["GPU utilization"][0])
    for profile in ("interactive", "bulk"):
        burst = [at for at, value in rate.items() if value > 250 and in_force.get(at) == profile]
        loads = sorted(busy[at] for at in burst if at in busy)
        sizes = [batch[at] for at in burst if at in batch]
        if loads and sizes:
            peak = max(rate[at] for at in burst)
            print(
                f"{profile} under the burst: {len(burst)} s, up to {peak:.0f} requests/s, "
                f"batches {min(sizes):.1f}-{max(sizes):.1f}, device busy "
                f"{100 * loads[len(loads) // 2]:.0f}% (median), {100 * loads[-1]:.0f}% (max)"
            )
    print(
        f"requests/s up to {max(rate.values()):.0f}; average batch {min(batch.values()):.1f}"
        f"-{max(batch.values()):.1f}; device busy up to {100 * max(busy.values()):.0f}%"
    )


@pytest.mark.timeout(240)
async def test_every_dashboard_panel_query_returns_data(
    triton_server: TritonFactory, prometheus_server: StartPrometheus, tmp_path: Path
) -> None:
    async with monitored_stacks.monitored_triton(
        triton_server,
        prometheus_server,
        tmp_path,
        policy=monitored_stacks.BURST_POLICY,
        slo_p95_ms=50,
        rule_files=[ALERTS],
    ) as stack:
        started = time.time()
        load = await stack.load(monitored_stacks.BURST)
        await asyncio.sleep(3)  # the last scrapes and rule evaluations
        ended = time.time()
        # Read while the runner still runs: once it stops, `up` goes to 0 and the
        # operator-down rule turns pending at Prometheus's next evaluation.
        rules = monitored_stacks.prometheus_get(stack.prometheus.url, "/api/v1/rules")["groups"]

    assert load.summary().failed == 0
    results: dict[str, list[list[Mapping[str, Any]]]] = {}
    for panel in dashboards.PANELS:
        results[panel.title] = []
        for query in panel.queries:
            expr = dashboards.instantiate(query.expr, rate_interval="10s")
            data = monitored_stacks.prometheus_get(
                stack.prometheus.url,
                "/api/v1/query_range",
                query=expr,
                start=f"{started:.3f}",
                end=f"{ended:.3f}",
                step=f"{STEP:g}",
            )
            assert data["result"], f"{panel.title}: no series for {expr}"
            finite = monitored_stacks.finite_values(data["result"])
            assert finite, f"{panel.title}: only NaN from {expr}"
            results[panel.title].append(data["result"])

    # The panels tell what happened: both profiles, a burst, batches that grew, a busy device.
    profiles = {
        series["metric"]["profile"]
        for series in results["Active profile"][0]
        if 1.0 in monitored_stacks.finite_values([series])
    }
    assert profiles == {"interactive", "bulk"}
    assert max(monitored_stacks.finite_values(results["Request rate"][0])) > 250
    assert max(monitored_stacks.finite_values(results["Average batch size"][0])) > 2
    utilization = monitored_stacks.finite_values(results["GPU utilization"][0])
    assert 0 < max(utilization) <= 1

    evaluated = {rule["name"]: rule for group in rules for rule in group["rules"]}
    assert set(evaluated) == {alert.name for alert in alerts.ALERTS}
    for name, rule in evaluated.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
    assert evaluated["BatchpilotOperatorDown"]["state"] == "inactive"

    report_figures(results)
    picture = os.environ.get(PICTURE)
    if picture:
        dashboard_plots.draw(
            results,
            start=started,
            step=STEP,
            path=Path(picture),
            title=(
                "batchpilot dashboard panels from a real Prometheus: tritonserver (CPU, gpu_sim), "
                "its sidecar and the standalone runner under a burst of load"
            ),
        )
