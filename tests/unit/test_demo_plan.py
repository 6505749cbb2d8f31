"""The demo's timeline: every switch it promises happens while it runs."""

from __future__ import annotations

import datetime

import pytest

from batchpilot.api import documents
from batchpilot.policy import decisions
from batchpilot_harness import demo
from builders import utc


@pytest.mark.parametrize("short", [True, False])
@pytest.mark.parametrize("second", [0, 17, 59])
def test_window_opens_after_the_burst_has_settled_and_before_the_load_ends(
    short: bool, second: int
) -> None:
    now = utc(2026, 11, 24, 23, 58, second)  # the window may cross midnight
    plan = demo.plan(now=now, short=short, model="gpu_sim")
    quiet, burst, _ = plan.phases
    spec = documents.parse_document(plan.policy)
    settled = now + datetime.timedelta(seconds=quiet.seconds + burst.seconds)
    assert plan.window_opens > settled + datetime.timedelta(seconds=spec.min_dwell_seconds)
    ends = now + datetime.timedelta(seconds=plan.seconds)
    assert plan.window_opens < ends - datetime.timedelta(seconds=5)
    (rule,) = spec.load.rules
    assert burst.rate >= 2 * rule.above
    assert rule.below is not None
    assert rule.below > quiet.rate
    assert plan.seconds < (120 if short else 240)
    at_window = decisions.decide(spec, plan.window_opens, decisions.Signals(), decisions.Memory())
    assert (at_window.profile, at_window.source) == ("bulk", "schedule")
