"""How early a scheduled change starts rolling out, so that it is complete at its boundary.

A rollout switches a policy's replicas in waves of `rollout.maxUnavailable`; its length is the
number of waves times how long one wave takes. `schedule.leadTime: auto` starts that long before
the boundary, plus a margin, from the policy's own measured wave time (the longest of its recent
rollouts), or from a conservative default until one was measured. A fixed lead is taken as
given, and compared with the expected rollout so that a fleet too large for it is reported
rather than silently late.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

from batchpilot.api import durations
from batchpilot.api.v1alpha1 import specs

DEFAULT_WAVE_SECONDS = 10.0
"""One wave's time before any was measured: five times the ~2 s a readiness-gate drain and a
reload of the demo model take, so the first boundary is early rather than late."""
MARGIN_FACTOR = 1.25
MARGIN_SECONDS = 2.0


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

    @property
    def sufficient(self) -> bool:
        """The rollout is expected to be over by the boundary (or nothing starts early)."""
        return self.lead == datetime.timedelta(0) or self.expected_rollout <= self.lead

    def describe(self) -> str:
        source = "measured" if self.measured else "assumed until one is measured"
        return (
            f"{self.waves} waves of {self.wave_seconds:.1f}s ({source}), about "
            f"{durations.format_duration(self.expected_rollout.total_seconds())}"
        )


def waves(replicas: int, max_unavailable: int) -> int:
    return max(math.ceil(replicas / max_unavailable), 1)


def lead_for(spec: specs.BatchPolicySpec, *, replicas: int, wave_seconds: float | None) -> Lead:
    """The lead `spec` asks for with this many replicas and this measured wave time."""
    count = waves(replicas, spec.rollout.max_unavailable)
    per_wave = wave_seconds if wave_seconds is not None else DEFAULT_WAVE_SECONDS
    expected = datetime.timedelta(seconds=count * per_wave)
    asked = spec.schedule.lead_time if spec.schedule else "0s"
    if asked == "auto":
        lead = expected * MARGIN_FACTOR + datetime.timedelta(seconds=MARGIN_SECONDS)
    else:
        lead = datetime.timedelta(seconds=durations.parse_duration(asked))
    return Lead(lead, expected, count, per_wave, wave_seconds is not None)


def wave_seconds(seconds: float, *, switched: int, max_unavailable: int) -> float | None:
    """One wave's time in a rollout that switched `switched` replicas in `seconds`."""
    if switched <= 0:
        return None
    return seconds / waves(switched, max_unavailable)
