"""What the check measured, per profile and per switch: pure functions of timed observations.

Device time comes from NVML's utilization, the fraction of its last sample period in which a
kernel ran, as the sidecar reports it. Sampled every half second or so, each reading stands for
the time since the previous one, so a profile's device-seconds are the integral of utilization
over the time it was in force, and its cost is that per 1,000 requests served in that time. A
profile is in force from the moment its reload finished until the next one did. A switch lasts
from the moment it was asked for until a second after its reload finished: requests sent then
are the switch's, the others are steady state. All times are seconds on one monotonic clock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from batchpilot_triton import scraping

SWITCH_TAIL_SECONDS = 1.0
"""How long after a reload a switch's requests are counted as the switch's."""


@dataclass(frozen=True)
class Sample:
    at: float
    utilization: float | None
    """0 to 1, over NVML's last sample period; None when the sidecar had no reading."""


@dataclass(frozen=True)
class Stretch:
    """A time during which one profile was in force."""

    profile: str
    start: float
    end: float


@dataclass(frozen=True)
class Switch:
    profile: str
    previous: str | None
    asked_at: float
    served_at: float
    """When the runner's tick that applied it returned."""
    reload_seconds: tuple[float, ...]
    """The actuator's time for each reload the switch made (load and verification)."""
    error: str | None = None

    @property
    def window(self) -> tuple[float, float]:
        return self.asked_at, self.served_at + SWITCH_TAIL_SECONDS


@dataclass(frozen=True)
class Request:
    sent: float
    latency: float | None
    """Seconds from sending to the end of the response; None without a response."""
    succeeded: bool
    error: str | None = None
    """What the client saw instead of an answer (the server's words, or the connection's)."""

    @property
    def done(self) -> float:
        return self.sent + (self.latency or 0.0)


def stretches(switches: Sequence[Switch], *, start: float, end: float) -> tuple[Stretch, ...]:
    """The profile in force over [start, end): each switch's from when it was served."""
    found = []
    ordered = sorted(switches, key=lambda switch: switch.served_at)
    for switch, following in zip(ordered, [*ordered[1:], None], strict=True):
        begins = max(switch.served_at, start)
        ends = min(following.served_at if following else end, end)
        if ends > begins:
            found.append(Stretch(switch.profile, begins, ends))
    return tuple(found)


def busy_seconds(samples: Sequence[Sample], start: float, end: float) -> tuple[float, float]:
    """(device-seconds, seconds covered by readings) over [start, end)."""
    busy = covered = 0.0
    ordered = sorted(samples, key=lambda sample: sample.at)
    for before, sample in itertools.pairwise(ordered):
        if sample.utilization is None:
            continue
        overlap = min(sample.at, end) - max(before.at, start)
        if overlap > 0:
            busy += sample.utilization * overlap
            covered += overlap
    return busy, covered


@dataclass(frozen=True, kw_only=True)
class Latencies:
    requests: int
    failed: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def latencies(requests: Iterable[Request]) -> Latencies:
    found = list(requests)
    ok = np.array([r.latency for r in found if r.succeeded and r.latency is not None]) * 1000.0
    p50, p99, top = (float(v) for v in np.percentile(ok, [50, 99, 100])) if ok.size else [None] * 3
    return Latencies(
        requests=len(found), failed=len(found) - int(ok.size), p50_ms=p50, p99_ms=p99, max_ms=top
    )


FAILURE_KINDS = 3
_FAILURE_TEXT = 160


def failure_kinds(requests: Iterable[Request], limit: int = FAILURE_KINDS) -> tuple[str, ...]:
    """The most frequent failures, as their text with a count: `418 x HTTP 500: ...`."""
    counts = collections.Counter(
        (r.error or "no answer")[:_FAILURE_TEXT] for r in requests if not r.succeeded
    )
    return tuple(f"{count} x {text}" for text, count in counts.most_common(limit))


def _within(request: Request, windows: Iterable[tuple[float, float]]) -> bool:
    return any(start <= request.sent < end for start, end in windows)


@dataclass(frozen=True, kw_only=True)
class ProfileAccount:
    profile: str
    seconds: float
    requests: int
    """Requests sent while the profile was in force."""
    failed: int
    """Of those, the ones that failed."""
    served: int
    """Requests that succeeded and finished while the profile was in force."""
    steady: Latencies
    """Requests sent while it was in force, outside every switch."""
    switching: Latencies
    """Requests sent during the switches to it."""
    device_seconds: float | None
    """NVML's utilization integrated over its time; None without readings."""
    covered_seconds: float
    counted: scraping.ModelCounters
    """What Triton (and the model's own device timer) counted while it was in force."""

    @property
    def utilization(self) -> float | None:
        if self.device_seconds is None or not self.covered_seconds:
            return None
        return self.device_seconds / self.covered_seconds

    @property
    def device_seconds_per_1000(self) -> float | None:
        if self.device_seconds is None or not self.served:
            return None
        return 1000.0 * self.device_seconds / self.served

    @property
    def timer_seconds_per_1000(self) -> float | None:
        """The same from the model's own timer around each batch (its emulated-device lock)."""
        if not self.served or not self.counted.device_executions:
            return None
        return 1000.0 * self.counted.device_busy_seconds / self.served


def profile_accounts(
    *,
    switches: Sequence[Switch],
    requests: Sequence[Request],
    samples: Sequence[Sample],
    counted: Mapping[Stretch, scraping.ModelCounters],
    start: float,
    end: float,
) -> tuple[ProfileAccount, ...]:
    found = stretches(switches, start=start, end=end)
    windows = [switch.window for switch in switches]
    accounts = []
    for profile in dict.fromkeys(stretch.profile for stretch in found):
        mine = [stretch for stretch in found if stretch.profile == profile]

        def inside(moment: float, mine: Sequence[Stretch] = mine) -> bool:
            return any(stretch.start <= moment < stretch.end for stretch in mine)

        busy = [busy_seconds(samples, stretch.start, stretch.end) for stretch in mine]
        covered = sum(seconds for _, seconds in busy)
        total = scraping.ModelCounters()
        for stretch in mine:
            total = _add(total, counted.get(stretch, scraping.ModelCounters()))
        to_me = [switch.window for switch in switches if switch.profile == profile]
        sent = [r for r in requests if inside(r.sent)]
        accounts.append(
            ProfileAccount(
                profile=profile,
                seconds=sum(stretch.end - stretch.start for stretch in mine),
                requests=len(sent),
                failed=sum(1 for r in sent if not r.succeeded),
                served=sum(1 for r in requests if r.succeeded and inside(r.done)),
                steady=latencies(r for r in sent if not _within(r, windows)),
                switching=latencies(r for r in requests if _within(r, to_me)),
                device_seconds=sum(value for value, _ in busy) if covered else None,
                covered_seconds=covered,
                counted=total,
            )
        )
    return tuple(accounts)


def _add(first: scraping.ModelCounters, second: scraping.ModelCounters) -> scraping.ModelCounters:
    return scraping.ModelCounters(
        **{
            field.name: getattr(first, field.name) + getattr(second, field.name)
            for field in dataclasses.fields(scraping.ModelCounters)
        }
    )


def counters_by_stretch(
    found: Sequence[Stretch], snapshots: Sequence[scraping.Snapshot], model: str
) -> dict[Stretch, scraping.ModelCounters]:
    """What Triton counted for `model` in each stretch: the increase between the snapshots of
    its metrics taken nearest the stretch's start and end (`taken_at` on the same clock)."""

    def nearest(moment: float) -> scraping.Snapshot:
        return min(snapshots, key=lambda snapshot: abs(snapshot.taken_at - moment))

    if not snapshots:
        return {}
    return {
        stretch: scraping.increase(nearest(stretch.start), nearest(stretch.end), model)
        for stretch in found
    }


@dataclass(frozen=True, kw_only=True)
class SwitchAccount:
    switch: Switch
    requests: Latencies
    """Requests sent during the switch."""

    @property
    def decision_to_served_seconds(self) -> float:
        return self.switch.served_at - self.switch.asked_at


def switch_accounts(
    switches: Sequence[Switch], requests: Sequence[Request]
) -> tuple[SwitchAccount, ...]:
    return tuple(
        SwitchAccount(
            switch=switch, requests=latencies(r for r in requests if _within(r, [switch.window]))
        )
        for switch in switches
    )
