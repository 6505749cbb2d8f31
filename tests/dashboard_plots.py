"""The dashboard's panels drawn with matplotlib from Prometheus range queries.

The Grafana the tests build runs without its web front end (see README), so this draws the
same panels from the same queries (batchpilot_charts.dashboards.PANELS) for the README's picture,
which tests/integration/test_grafana.py takes from real data (`make dashboard-png`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

from batchpilot_charts import dashboards

Series = Mapping[str, Any]
"""One series of a Prometheus matrix result: {"metric": {...}, "values": [[t, "v"], ...]}."""

# Grafana unit -> (scale, axis label)
_UNITS = {
    "s": (1000.0, "ms"),
    "µs": (0.001, "ms"),
    "reqps": (1.0, "requests/s"),
    "percentunit": (100.0, "%"),
    "bytes": (1 / 2**30, "GiB"),
    "short": (1.0, ""),
}


def legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def _points(series: Series, start: float, *, step: float) -> tuple[list[float], list[float]]:
    """Finite points, with a NaN wherever the series was absent, so that no line bridges it."""
    times: list[float] = []
    values: list[float] = []
    for stamp, text in series["values"]:
        value = float(text)
        if not math.isfinite(value):
            continue
        at = float(stamp) - start
        if times and at - times[-1] > 1.5 * step:
            times.append(times[-1] + step)
            values.append(math.nan)
        times.append(at)
        values.append(value)
    return times, values


def _state_timeline(axes: Any, results: Sequence[Series], start: float, step: float) -> None:
    rows = sorted({legend(dashboards.NAMED, s["metric"]) for s in results})
    colors = plt.get_cmap("tab10")
    profiles = sorted({s["metric"].get("profile", "") for s in results})
    for series in results:
        row = rows.index(legend(dashboards.NAMED, series["metric"]))
        profile = series["metric"].get("profile", "")
        color = colors(profiles.index(profile))
        times, values = _points(series, start, step=step)
        spans = [(time, step) for time, value in zip(times, values, strict=True) if value == 1]
        axes.broken_barh(spans, (row - 0.35, 0.7), color=color, label=profile)
    axes.set_yticks(range(len(rows)), rows)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")


def draw(
    results: Mapping[str, Sequence[Sequence[Series]]],
    *,
    start: float,
    step: float,
    path: Path,
    title: str,
) -> None:
    """One subplot per panel; `results[panel.title][i]` is the matrix of the panel's i-th query."""
    panels = dashboards.PANELS
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(14, 3.1 * rows), squeeze=False)
    for index, panel in enumerate(panels):
        axes = grid[index // columns][index % columns]
        axes.set_title(panel.title, fontsize=10, loc="left")
        scale, unit = _UNITS[panel.unit]
        if panel.kind == "state-timeline":
            _state_timeline(axes, results[panel.title][0], start, step)
        else:
            for query, matrix in zip(panel.queries, results[panel.title], strict=True):
                for series in matrix:
                    times, values = _points(series, start, step=step)
                    axes.plot(
                        times,
                        [value * scale for value in values],
                        label=legend(query.legend, series["metric"]),
                        linewidth=1.2,
                    )
            axes.set_ylabel(unit, fontsize=8)
            axes.legend(fontsize=7, loc="upper left")
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
        axes.set_xlabel("seconds", fontsize=8)
    for index in range(len(panels), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(path, dpi=90)
    plt.close(figure)
