"""Exchange trading sessions, from the maintained `exchange_calendars` library.

Holidays and early closes change every year and differ by exchange; a hand-kept list would be
wrong by next December. The library computes them from each exchange's rules, offline, so this
stays pure: no network, no clock.

The library is imported when a policy first names a calendar, not with the policy core
(`batchpilot.api.calendar_names`, which also says which calendars exist).
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import Any

from batchpilot.api import calendar_names
from batchpilot.api.calendar_names import CalendarsUnavailable

__all__ = ["CalendarsUnavailable", "Session", "session_on"]


@dataclass(frozen=True)
class Session:
    """One trading session, as aware UTC instants."""

    opens: datetime.datetime
    closes: datetime.datetime


@functools.lru_cache(maxsize=64)
def _calendar_for_year(name: str, year: int) -> Any:
    # Built for a bounded range around the year asked about: the library's default range is
    # "around today", which would make answers depend on the wall clock.
    return calendar_names.library().get_calendar(
        name, start=f"{year - 1}-01-01", end=f"{year + 1}-12-31"
    )


def session_on(name: str, day: datetime.date) -> Session | None:
    """The session labelled `day` on the exchange, or None when it does not trade that day."""
    calendar = _calendar_for_year(name, day.year)
    import pandas  # installed with exchange-calendars, which the calendar above needed

    label = pandas.Timestamp(day)
    if not calendar.is_session(label):
        return None
    return Session(
        opens=calendar.session_open(label).to_pydatetime().astimezone(datetime.UTC),
        closes=calendar.session_close(label).to_pydatetime().astimezone(datetime.UTC),
    )
