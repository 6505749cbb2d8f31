"""Exchange trading sessions, from the maintained `exchange_calendars` library.

Holidays and early closes change every year and differ by exchange; a hand-kept list would be
wrong by next December. The library computes them from each exchange's rules, offline, so this
stays pure: no network, no clock.

The library (and pandas under it, about 100 MB installed) is imported when a policy first names a
calendar, not with the policy core: the standalone runner and the operator run policies without
one on machines that do not carry it (a GPU machine reached only by copying wheels). A policy that
names a calendar where the library is missing fails validation with that reason.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Session:
    """One trading session, as aware UTC instants."""

    opens: datetime.datetime
    closes: datetime.datetime


class CalendarsUnavailable(RuntimeError):
    """The `exchange-calendars` library is not installed."""


@functools.cache
def _library() -> Any:
    try:
        import exchange_calendars
    except ImportError as error:
        raise CalendarsUnavailable(
            f"exchange calendars need the exchange-calendars package, which is not installed "
            f"({error})"
        ) from None
    return exchange_calendars


@functools.cache
def known_names() -> frozenset[str]:
    return frozenset(_library().get_calendar_names(include_aliases=True))


def is_known(name: str) -> bool:
    return name in known_names()


@functools.lru_cache(maxsize=64)
def _calendar_for_year(name: str, year: int) -> Any:
    # Built for a bounded range around the year asked about: the library's default range is
    # "around today", which would make answers depend on the wall clock.
    return _library().get_calendar(name, start=f"{year - 1}-01-01", end=f"{year + 1}-12-31")


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
