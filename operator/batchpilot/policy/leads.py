"""How early a scheduled change starts rolling out, so that it is complete at its boundary.

A rollout switches a policy's replicas in waves of `rollout.maxUnavailable`; its length is the
number of waves times how long one wave takes. `schedule.leadTime: auto` starts that long before
the boundary, plus a margin, from the policy's measured wave time, or from a conservative default
until one was measured. A fixed lead is taken as given, and compared with the expected rollout
so that a fleet too large for it is reported rather than silently late.

A wave measured alone is shorter than the same wave at a boundary where many policies switch at
once: their reloads share the nodes' cores and GPUs (on a 2-core node, eight reloads started
together took 3.9 to 9.3 s). So the measured wave is the longest of the
policy's own recent waves and of the waves of the rollouts that ran beside one of them on the
same nodes (`Contention`): the busiest rollout a policy took part in is what it plans for.

With a canary (`rollout.canary`), a switch into settings the fleet has not proven first goes to
the canary replicas and waits out `analysisSeconds` before the rest follow: `auto` plans for
that wave and that analysis too, so a first switch into a new profile is in force at its
boundary; a fixed lead shorter than it is reported insufficient.
"""

from __future__ import annotations

import collections
import datetime
import math
from collections.abc import Iterable
from dataclasses import dataclass

from batchpilot.api import durations
from batchpilot.api.v1alpha1 import specs

DEFAULT_WAVE_SECONDS = 10.0
"""One wave's time before any was measured: five times the ~2 s a readiness-gate drain and a
reload of the demo model take, so the first boundary is early rather than late."""
MARGIN_FACTOR = 1.25
MARGIN_SECONDS = 2.0
WAVES_PER_NODE = 256
"""Recent waves remembered per node: enough for every policy of a large fleet switching at one
boundary, bounded however many rollouts a node sees."""
NODE_HORIZON = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Lead:
    """A policy's lead time, and the rollout it is meant to cover."""

    lead: datetime.timedelta
    """How long before a boundary a change into a latency profile is decided."""
    expected_rollout: datetime.timedelta
    """How long switching every replica is expected to take."""
    waves: int
    wave_seconds: float
    measured: bool
    """The wave time was measured on this policy's rollouts, not assumed."""
    contended: bool = False
    """The wave time is that of a rollout which ran beside one of this policy's on its nodes,
    longer than any of its own."""
    canary_seconds: float = 0.0
    """The canary's own wave and analysis in `expected_rollout`, when the settings a lead
    switches into are not proven yet; 0 otherwise."""

    @property
    def sufficient(self) -> bool:
        """The rollout is expected to be over by the boundary (or nothing starts early)."""
        return self.lead == datetime.timedelta(0) or self.expected_rollout <= self.lead

    def describe(self) -> str:
        source = (
            "measured beside other rollouts on its nodes"
            if self.contended
            else "measured"
            if self.measured
            else "assumed until one is measured"
        )
        canary = (
            f" after a canary's wave and analysis ({self.canary_seconds:.0f}s)"
            if self.canary_seconds
            else ""
        )
        return (
            f"{self.waves} waves of {self.wave_seconds:.1f}s ({source}){canary}, about "
            f"{durations.format_duration(self.expected_rollout.total_seconds())}"
        )


def waves(replicas: int, max_unavailable: int) -> int:
    return max(math.ceil(replicas / max_unavailable), 1)


def lead_for(
    spec: specs.BatchPolicySpec,
    *,
    replicas: int,
    wave_seconds: float | None,
    contended_wave_seconds: float | None = None,
    through_canary: bool = False,
) -> Lead:
    """The lead `spec` asks for with this many replicas and this measured wave time (its own,
    and the longest of the rollouts that ran beside its own on its nodes); `through_canary`
    when a switch the lead covers goes through a canary first (settings not proven yet)."""
    count = waves(replicas, spec.rollout.max_unavailable)
    contended = contended_wave_seconds is not None and (
        wave_seconds is None or contended_wave_seconds > wave_seconds
    )
    if contended:
        wave_seconds = contended_wave_seconds
    per_wave = wave_seconds if wave_seconds is not None else DEFAULT_WAVE_SECONDS
    canary = spec.rollout.canary
    canary_seconds = per_wave + canary.analysis_seconds if through_canary and canary else 0.0
    expected = datetime.timedelta(seconds=count * per_wave + canary_seconds)
    asked = spec.schedule.lead_time if spec.schedule else "0s"
    if asked == "auto":
        lead = expected * MARGIN_FACTOR + datetime.timedelta(seconds=MARGIN_SECONDS)
    else:
        lead = datetime.timedelta(seconds=durations.parse_duration(asked))
    return Lead(
        lead, expected, count, per_wave, wave_seconds is not None, contended, canary_seconds
    )


def wave_seconds(seconds: float, *, switched: int, max_unavailable: int) -> float | None:
    """One wave's time in a rollout that switched `switched` replicas in `seconds`."""
    if switched <= 0:
        return None
    return seconds / waves(switched, max_unavailable)


@dataclass(frozen=True)
class Wave:
    """One rollout's wave time, and when the rollout ran."""

    started: datetime.datetime
    ended: datetime.datetime
    seconds: float

    def overlaps(self, other: Wave) -> bool:
        return self.started <= other.ended and other.started <= self.ended


class Contention:
    """The waves of every policy's recent rollouts, by the nodes they reloaded on.

    Shared by all the policies one operator governs. A policy asks for the longest wave of the
    rollouts that overlapped one of its own on one of its nodes: what its wave takes when the
    node's fleet switches together. It learns no more than that of other policies (no names, no
    namespaces), and only ever to start earlier.
    """

    def __init__(self, per_node: int = WAVES_PER_NODE) -> None:
        self._per_node = per_node
        self._waves: dict[str, collections.deque[Wave]] = {}
        self.recorded = 0
        """Waves recorded so far: what a policy read of this stays true until."""

    def record(self, nodes: Iterable[str], wave: Wave) -> None:
        self.recorded += 1
        for node in set(nodes):
            self._waves.setdefault(node, collections.deque(maxlen=self._per_node)).append(wave)
        # A node that saw no rollout for a week is gone or idle: a cluster that replaces its
        # nodes does not grow this.
        for node in [
            n for n, waves in self._waves.items() if waves[-1].ended < wave.ended - NODE_HORIZON
        ]:
            del self._waves[node]

    def busiest(self, nodes: Iterable[str], beside: Iterable[Wave]) -> float | None:
        """The longest wave on `nodes` of a rollout that ran at the same time as one of
        `beside`; None when none did."""
        own = tuple(beside)
        return max(
            (
                wave.seconds
                for node in set(nodes)
                for wave in self._waves.get(node, ())
                if any(wave.overlaps(mine) for mine in own)
            ),
            default=None,
        )
