"""Small builders shared by the unit tests: specs from the base policy, aware instants."""

from __future__ import annotations

import copy
import datetime
from typing import Any
from zoneinfo import ZoneInfo

from batchpilot.api import documents
from batchpilot.api.v1alpha1 import specs

NEW_YORK = ZoneInfo("America/New_York")

BASE_SPEC: dict[str, Any] = {
    "target": {"selector": {"matchLabels": {"app": "triton"}}},
    "profiles": {
        "interactive": {"maxQueueDelayMicroseconds": 2000, "preferredBatchSizes": [4, 8]},
        "bulk": {"maxQueueDelayMicroseconds": 50000, "preferredBatchSizes": [64, 128]},
    },
    "defaultProfile": "bulk",
    "minDwellSeconds": 0,
}

WEEKDAYS = ["Mon", "Tue", "Wed", "Thu", "Fri"]


def ny(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime.datetime:
    """An aware New York wall-clock time."""
    return datetime.datetime(year, month, day, hour, minute, second, tzinfo=NEW_YORK)


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime.datetime:
    return datetime.datetime(year, month, day, hour, minute, second, tzinfo=datetime.UTC)


def spec_document(**fields: Any) -> dict[str, Any]:
    """The base spec with some top-level fields replaced, as a plain document."""
    document = copy.deepcopy(BASE_SPEC)
    document.update(fields)
    return document


def make_spec(**fields: Any) -> specs.BatchPolicySpec:
    return documents.parse_spec(spec_document(**fields))


def window(profile: str, start: str, end: str, days: list[str] | None = None) -> dict[str, Any]:
    return {"profile": profile, "days": days or WEEKDAYS, "start": start, "end": end}


def market_hours(**schedule: Any) -> dict[str, Any]:
    """Interactive on weekdays 09:30-16:00 New York time, plus any other schedule fields."""
    return {
        "timezone": "America/New_York",
        "windows": [window("interactive", "09:30", "16:00")],
        **schedule,
    }
