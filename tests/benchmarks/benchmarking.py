"""What the benchmarks share: the compressed trading day, per-window and per-phase accounting,
tables and plots.

A benchmark replays traffic with `batchpilot_harness.loadgen` (open-loop Poisson arrivals, one
record per request) and scrapes Triton's metrics page once a second. Everything here turns those two
streams into figures, and is pure: the unit tests feed it made-up records and snapshots.

Times are seconds after the start of the load (`RequestRecord.scheduled`), called offsets. A
trading day is replayed compressed: an offset maps to the instant `day start + speed * offset`
of the virtual day, which is also what the policy's clock reads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import shutil
import sys
import time
import zoneinfo
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from batchpilot_harness import loadgen
from batchpilot_triton import scraping

if TYPE_CHECKING:
    from batchpilot_testbed.kubes import Kube

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".bench"
"""Where a run writes its figures (ignored by git)."""
RESULTS = Path(__file__).resolve().parent / "results"
"""Where `--publish` copies the plots and Markdown summaries the README shows."""

WINDOW_SECONDS = 10.0


# -- the trading day --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DayPhase:
    """A part of the day reported on its own, with its base arrival rate."""

    name: str
    start: datetime.time
    end: datetime.time
    rate: float
    description: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Burst:
    """A stretch of a phase at another rate."""

    label: str
    start: datetime.time
    end: datetime.time
    rate: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of constant arrival rate, in offsets."""

    phase: int
    start: float
    end: float
    rate: float
    label: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class TradingDay:
    """Phases of one local day, replayed `speed` times faster than real time.

    Phases are contiguous and in order; bursts lie within phases."""

    date: datetime.date
    timezone: str
    phases: tuple[DayPhase, ...]
    bursts: tuple[Burst, ...] = ()
    speed: float = 1.0

    def __post_init__(self) -> None:
        for before, after in itertools.pairwise(self.phases):
            if before.end != after.start:
                raise ValueError(f"phase {after.name} does not start where {before.name} ends")
        for phase in self.phases:
            if phase.end <= phase.start:
                raise ValueError(f"phase {phase.name} ends before it starts")
        for burst in self.bursts:
            if not any(p.start <= burst.start < burst.end <= p.end for p in self.phases):
                raise ValueError(f"burst {burst.label} does not lie within one phase")

    def instant(self, local: datetime.time) -> datetime.datetime:
        return datetime.datetime.combine(self.date, local, zoneinfo.ZoneInfo(self.timezone))

    @property
    def start(self) -> datetime.datetime:
        return self.instant(self.phases[0].start)

    def offset(self, local: datetime.time) -> float:
        """Seconds after the start of the load at which the virtual day reaches `local`."""
        return (self.instant(local) - self.start).total_seconds() / self.speed

    def virtual(self, offset: float) -> datetime.datetime:
        """The instant of the virtual day at `offset` seconds into the load."""
        return self.start + datetime.timedelta(seconds=offset * self.speed)

    @property
    def seconds(self) -> float:
        return self.offset(self.phases[-1].end)

    def bounds(self, phase: int) -> tuple[float, float]:
        return self.offset(self.phases[phase].start), self.offset(self.phases[phase].end)

    def segments(self) -> list[Segment]:
        found = []
        for index, phase in enumerate(self.phases):
            cursor = phase.start
            inside = sorted(
                (b for b in self.bursts if phase.start <= b.start < phase.end),
                key=lambda b: b.start,
            )
            for burst in inside:
                if burst.start > cursor:
                    found.append(self._segment(index, cursor, burst.start, phase.rate, phase.name))
                found.append(self._segment(index, burst.start, burst.end, burst.rate, burst.label))
                cursor = burst.end
            if cursor < phase.end:
                found.append(self._segment(index, cursor, phase.end, phase.rate, phase.name))
        return found

    def _segment(
        self, phase: int, start: datetime.time, end: datetime.time, rate: float, label: str
    ) -> Segment:
        return Segment(
            phase=phase, start=self.offset(start), end=self.offset(end), rate=rate, label=label
        )

    def load_phases(self) -> tuple[loadgen.Phase, ...]:
        """The day as loadgen's schedule: one loadgen phase per segment."""
        return tuple(
            loadgen.Phase(rate=segment.rate, seconds=segment.end - segment.start)
            for segment in self.segments()
        )

    def phase_of(self, offset: float) -> int | None:
        for index in range(len(self.phases)):
            start, end = self.bounds(index)
            if start <= offset < end:
                return index
        return None

    def clock(
        self, origin: float, *, monotonic: Callable[[], float] = time.monotonic
    ) -> Callable[[], datetime.datetime]:
        """A clock for the policy: the virtual instant, given the load started at `origin`
        (a `time.monotonic()` reading); before the load it reads the start of the day."""

        def now() -> datetime.datetime:
            return self.virtual(max(monotonic() - origin, 0.0))

        return now

    def label(self, offset: float) -> str:
        return self.virtual(offset).strftime("%H:%M")


# -- per-request accounting -------------------------------------------------------------------


def percentiles_ms(
    records: Sequence[loadgen.RequestRecord], quantiles: Sequence[float] = (50, 95, 99)
) -> list[float | None]:
    """Latency percentiles of the successful requests, in milliseconds."""
    latencies = [r.latency for r in records if r.succeeded and r.latency is not None]
    if not latencies:
        return [None] * len(quantiles)
    values = np.percentile(np.array(latencies) * 1000.0, list(quantiles))
    return [float(v) for v in values]


def failures(records: Sequence[loadgen.RequestRecord]) -> int:
    """Requests without a successful response, those never sent (in-flight bound) included."""
    return sum(not r.succeeded for r in records)


def between(
    records: Sequence[loadgen.RequestRecord], start: float, end: float
) -> list[loadgen.RequestRecord]:
    """Requests scheduled in [start, end)."""
    return [r for r in records if start <= r.scheduled < end]


def overlapping(
    records: Sequence[loadgen.RequestRecord], start: float, end: float
) -> list[loadgen.RequestRecord]:
    """Requests in flight at some time in [start, end): a reload stalls the requests already
    queued when it begins, not only those sent after it."""
    found = []
    for record in records:
        began = record.scheduled if record.sent is None else record.sent
        finished = began + (record.latency or 0.0)
        if began < end and finished >= start:
            found.append(record)
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    """What requests scheduled within one window of time saw."""

    start: float
    end: float
    requests: int
    succeeded: int
    p95_ms: float | None
    p99_ms: float | None = None

    @property
    def failed(self) -> int:
        return self.requests - self.succeeded

    @property
    def throughput(self) -> float:
        return self.succeeded / (self.end - self.start)

    def meets(self, slo_ms: float) -> bool:
        """p95 within the objective and no failed request; an empty window meets it."""
        if self.requests == 0:
            return True
        return self.failed == 0 and self.p95_ms is not None and self.p95_ms <= slo_ms


def windows(
    records: Sequence[loadgen.RequestRecord],
    *,
    start: float,
    end: float,
    width: float = WINDOW_SECONDS,
) -> list[Window]:
    """Consecutive windows from `start`; a last window shorter than half a width is left out
    (it would judge a few requests as if they were many)."""
    found: list[Window] = []
    cursor = start
    while cursor < end - 1e-9:
        stop = min(cursor + width, end)
        if stop - cursor < width / 2 and found:
            break
        inside = between(records, cursor, stop)
        p95, p99 = percentiles_ms(inside, (95, 99))
        found.append(
            Window(
                start=cursor,
                end=stop,
                requests=len(inside),
                succeeded=sum(r.succeeded for r in inside),
                p95_ms=p95,
                p99_ms=p99,
            )
        )
        cursor = stop
    return found


def share_meeting(found: Sequence[Window], slo_ms: float) -> float | None:
    if not found:
        return None
    return sum(window.meets(slo_ms) for window in found) / len(found)


# -- server-side accounting -------------------------------------------------------------------


def add(first: scraping.ModelCounters, second: scraping.ModelCounters) -> scraping.ModelCounters:
    return scraping.ModelCounters(
        **{
            field.name: getattr(first, field.name) + getattr(second, field.name)
            for field in dataclasses.fields(scraping.ModelCounters)
        }
    )


def counted_between(
    series: Sequence[scraping.Snapshot], model: str, start: float, end: float
) -> scraping.ModelCounters:
    """What the server counted for `model` between scrapes whose interval's middle lies in
    [start, end); snapshots are taken at offsets (`taken_at`), in order."""
    total = scraping.ModelCounters()
    for before, after in itertools.pairwise(series):
        middle = (before.taken_at + after.taken_at) / 2
        if start <= middle < end:
            total = add(total, scraping.increase(before, after, model))
    return total


def device_seconds_per_1000(counted: scraping.ModelCounters) -> float | None:
    """Device busy time per 1,000 inferences: the emulated device's busy seconds (a GPU's busy
    time on a real one)."""
    return counted.device_seconds_per_1000_inferences


# -- per-phase reports ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseReport:
    phase: str
    seconds: float
    requests: int
    failed: int
    throughput: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    windows: int
    windows_meeting_slo: int
    average_batch: float | None
    device_seconds_per_1000: float | None

    @property
    def share_meeting_slo(self) -> float | None:
        return self.windows_meeting_slo / self.windows if self.windows else None


def phase_report(
    *,
    name: str,
    records: Sequence[loadgen.RequestRecord],
    series: Sequence[scraping.Snapshot],
    model: str,
    start: float,
    end: float,
    slo_ms: float,
) -> PhaseReport:
    inside = between(records, start, end)
    p50, p95, p99 = percentiles_ms(inside)
    found = windows(records, start=start, end=end)
    counted = counted_between(series, model, start, end)
    return PhaseReport(
        phase=name,
        seconds=end - start,
        requests=len(inside),
        failed=failures(inside),
        throughput=sum(r.succeeded for r in inside) / (end - start),
        p50_ms=p50,
        p95_ms=p95,
        p99_ms=p99,
        windows=len(found),
        windows_meeting_slo=sum(window.meets(slo_ms) for window in found),
        average_batch=counted.average_batch_size,
        device_seconds_per_1000=device_seconds_per_1000(counted),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# -- tables -----------------------------------------------------------------------------------


def cell(value: object, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [
        max(len(headers[i]), *(len(row[i]) for row in rows)) if rows else len(headers[i])
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            value.ljust(width) if i == 0 else value.rjust(width)
            for i, (value, width) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- plots ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeline:
    """One contender's day, window by window."""

    label: str
    windows: tuple[Window, ...]


def plot_day(
    path: Path,
    *,
    day: TradingDay,
    timelines: Sequence[Timeline],
    slo_ms: float,
    title: str,
    markers: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> None:
    """p95 latency and throughput per window over the virtual day, one line per contender,
    phases shaded; `markers` draws a contender's events (profile switches) as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, throughput) = plt.subplots(
        2, 1, figsize=(10, 6.2), sharex=True, height_ratios=(3, 2)
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shades = ("#f2f2f2", "#e0e8f4")
    for index, phase in enumerate(day.phases):
        start, end = day.bounds(index)
        for axis in (latency, throughput):
            axis.axvspan(start, end, color=shades[index % 2], zorder=0)
        latency.text(
            (start + end) / 2, 1.01, phase.name, transform=latency.get_xaxis_transform(),
            ha="center", va="bottom", fontsize=8,
        )  # fmt: skip
    for index, timeline in enumerate(timelines):
        colour = colours[index % len(colours)]
        middles = [(w.start + w.end) / 2 for w in timeline.windows]
        p95 = [w.p95_ms if w.p95_ms is not None else math.nan for w in timeline.windows]
        latency.plot(middles, p95, label=timeline.label, color=colour, linewidth=1.2)
        throughput.plot(
            middles, [w.throughput for w in timeline.windows], color=colour, linewidth=1.2
        )
        for offset, _ in (markers or {}).get(timeline.label, ()):
            latency.axvline(offset, color=colour, linewidth=0.6, linestyle=":", zorder=1)
    latency.axhline(slo_ms, color="black", linewidth=0.8, linestyle="--")
    latency.text(0, slo_ms, f" SLO p95 {slo_ms:g} ms", va="bottom", fontsize=8)
    latency.set_yscale("log")
    width = timelines[0].windows[0].end - timelines[0].windows[0].start if timelines else 0.0
    latency.set_ylabel(f"p95 latency per {width:.2g} s (ms)")
    throughput.set_ylabel("served (req/s)")
    ticks = [day.bounds(i)[0] for i in range(len(day.phases))] + [day.seconds]
    throughput.set_xticks(ticks, [day.label(t) for t in ticks])
    throughput.set_xlabel(
        f"virtual time of day ({day.timezone}, {day.date:%a %Y-%m-%d}), replayed "
        f"{day.speed:g}x faster: {day.seconds:.0f} s"
    )
    latency.legend(loc="upper left", fontsize=8, ncols=3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_timelines(
    path: Path,
    *,
    timelines: Sequence[Timeline],
    title: str,
    markers: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> None:
    """p99 latency per window over time, one panel per timeline, events (switches) marked and
    windows with failed requests crossed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        len(timelines), 1, figsize=(10, 2.4 * len(timelines)), sharex=True, squeeze=False
    )
    for axis, timeline in zip(axes[:, 0], timelines, strict=True):
        middles = [(w.start + w.end) / 2 for w in timeline.windows]
        values = [w.p99_ms if w.p99_ms is not None else math.nan for w in timeline.windows]
        axis.plot(middles, values, linewidth=1.2)
        failed = [
            (m, v) for m, v, w in zip(middles, values, timeline.windows, strict=True) if w.failed
        ]
        if failed:
            axis.scatter(*zip(*failed, strict=True), color="red", marker="x", zorder=3)
        for offset, label in (markers or {}).get(timeline.label, ()):
            axis.axvline(offset, color="grey", linewidth=0.8, linestyle=":")
            axis.text(offset, 1.0, f" {label}", transform=axis.get_xaxis_transform(),
                      fontsize=7, va="top")  # fmt: skip
        axis.set_yscale("log")
        axis.set_ylabel("p99 latency (ms)")
        axis.set_title(timeline.label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


# -- output -----------------------------------------------------------------------------------


def output_arguments(parser: argparse.ArgumentParser) -> None:
    """`--out` and `--publish`, alike for every benchmark."""
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="for the JSON, Markdown and plots"
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help=f"also copy the plots and the Markdown summary into {RESULTS.relative_to(REPO)}",
    )


def write_summary(
    out_dir: Path,
    stem: str,
    *,
    tables: Callable[..., str],
    data: object,
    out: TextIO | None = None,
) -> None:
    """The `tables(markdown=...)` as text on `out` (stdout), and in `out_dir` as `<stem>.md`
    beside `<stem>.json` (the figures)."""
    (out or sys.stdout).write("\n" + tables(markdown=False) + "\n")
    (out_dir / f"{stem}.md").write_text(tables(markdown=True) + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1))


def publish(out_dir: Path, names: Sequence[str]) -> None:
    """Copy these files of a run into RESULTS, for the README."""
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        shutil.copy2(out_dir / name, RESULTS / name)


# -- the local cluster ------------------------------------------------------------------------


@contextlib.contextmanager
def local_cluster(
    *, wait_seconds: float = 900.0, say: Callable[[str], None] = print
) -> Iterator[Kube]:
    """An `batchpilot_testbed.kubes.Kube` on a local cluster: the one this checkout's `make
    cluster-up` left
    running, else the one that holds the machine's pod network now (another checkout's), else
    one started here and stopped at the end. While another cluster is starting or stopping,
    wait for it (up to `wait_seconds`); never stop a cluster this did not start."""
    from batchpilot_cluster import building, controlplane, locations, podnetwork
    from batchpilot_testbed import kubes

    def kube(cluster: controlplane.Cluster) -> Kube:
        return kubes.Kube(
            kubeconfig=cluster.kubeconfig,
            context=kubes.current_context(cluster.kubeconfig),
            local=cluster,
        )

    deadline = time.monotonic() + wait_seconds
    while True:
        own = locations.state_dir()
        if controlplane.is_up(own):
            say(f"using the local cluster in {own}")
            yield kube(controlplane.Cluster.load(own))
            return
        holder = podnetwork.holder()
        if holder is not None and controlplane.is_up(Path(holder)):
            say(f"using the local cluster in {holder}, which holds the pod network")
            yield kube(controlplane.Cluster.load(Path(holder)))
            return
        if holder is None:
            building.require_binaries()
            stack = contextlib.ExitStack()
            try:
                cluster = stack.enter_context(controlplane.running(keep_logs=False, say=say))
            except controlplane.ClusterError as error:
                if "in use" not in str(error):
                    raise
            else:
                with stack:
                    yield kube(cluster)
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no local cluster: the pod network stayed busy ({holder})")
        say(f"another local cluster is starting or stopping ({holder}); waiting")
        time.sleep(10)


@contextlib.contextmanager
def operator_cluster(out_dir: Path, name: str) -> Iterator[tuple[Kube, Path]]:
    """`local_cluster()` with batchpilot's API installed, and a kubeconfig in `out_dir` that is
    the operator's ServiceAccount."""
    from batchpilot_testbed import operators

    with local_cluster() as kube:
        yield kube, operators.install_and_log_in(kube, out_dir / f"{name}-operator.kubeconfig")


@contextlib.contextmanager
def namespace(kube: Kube, prefix: str) -> Iterator[str]:
    """A fresh namespace (`batchpilot_testbed.namespaces`), more patient than a test's: a
    benchmark's fleet is
    larger. Delete BatchPolicies before its end, while an operator still runs: a `--baseline`
    from before batchpilot dropped kopf's finalizer must remove it."""
    from batchpilot_testbed import namespaces

    with namespaces.created(
        kube,
        namespaces.unique(prefix),
        label="batchpilot.dev/bench",
        ready_timeout=60,
    ) as name:
        yield name


def delete_policies(kube: Kube, namespace: str, *, timeout: float = 120.0) -> None:
    """Delete a namespace's BatchPolicies and wait until they are gone (an operator from before
    batchpilot dropped kopf's finalizer must still run, to remove it)."""
    import kubernetes.client

    from batchpilot_testbed import waiting

    api = kubernetes.client.CustomObjectsApi(kube.api_client)
    group, version, plural = "batchpilot.dev", "v1alpha1", "batchpolicies"
    api.delete_collection_namespaced_custom_object(group, version, namespace, plural)

    def gone() -> bool:
        listed = api.list_namespaced_custom_object(group, version, namespace, plural)
        return isinstance(listed, dict) and not listed.get("items")

    waiting.wait_for(
        f"the BatchPolicies of {namespace} deleted", gone, timeout=timeout, interval=0.5
    )
