"""Which profile the clock asks for, and when that next changes.

Windows are wall-clock times in the schedule's IANA time zone, so "09:30" stays 09:30 in New
York across daylight-saving changes. A window belongs to the local date it starts on: its
weekday and exception dates are that date's, and a window whose end is at or before its start
ends on the next date. A wall-clock time that a spring-forward skips is read with the offset in
force before the change (02:30 becomes 03:30); one that a fall-back repeats means its first
occurrence. With an exchange calendar, each occurrence is clipped to that date's session.
"""

from __future__ import annotations

import datetime
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from batchpilot.api.v1alpha1 import specs
from batchpilot.policy import calendars

# How far ahead to look for the next change before saying there is none. A year covers any
# run of holidays and exception dates a real schedule has.
LOOKAHEAD_DAYS = 400
_ONE_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Occurrence:
    """One window on one date, as aware instants: [starts, ends)."""

    window_index: int
    window: specs.Window
    day: datetime.date
    starts: datetime.datetime
    ends: datetime.datetime
    clipped_by_session: bool

    def covers(self, instant: datetime.datetime) -> bool:
        return self.starts <= instant < self.ends


def _wall_clock(day: datetime.date, hhmm: str, zone: datetime.tzinfo) -> datetime.datetime:
    """The UTC instant of a local wall-clock time.

    Everything here is compared in UTC: Python compares and subtracts two datetimes that share
    a tzinfo by their wall-clock readings, which is wrong across a DST change."""
    hours, minutes = (int(part) for part in hhmm.split(":"))
    if hours == 24:
        day, hours = day + _ONE_DAY, 0
    local = datetime.datetime.combine(day, datetime.time(hours, minutes), tzinfo=zone)
    return local.astimezone(datetime.UTC)


def occurrences_on(schedule: specs.Schedule, day: datetime.date) -> list[Occurrence]:
    """The windows that start on local date `day`, in precedence order."""
    if day in schedule.exceptions:
        return []
    session = calendars.session_on(schedule.calendar, day) if schedule.calendar else None
    if schedule.calendar and session is None:
        return []
    weekday = specs.WEEKDAYS[day.weekday()]
    found: list[Occurrence] = []
    for index, window in enumerate(schedule.windows):
        if weekday not in window.days:
            continue
        starts = _wall_clock(day, window.start, schedule.zone)
        ends = _wall_clock(day, window.end, schedule.zone)
        if window.end != "24:00" and window.end <= window.start:
            ends = _wall_clock(day + _ONE_DAY, window.end, schedule.zone)
        clipped = False
        if session is not None:
            clipped = starts < session.opens or ends > session.closes
            starts, ends = max(starts, session.opens), min(ends, session.closes)
        if starts < ends:
            found.append(Occurrence(index, window, day, starts, ends, clipped))
    return found


def active_occurrence(schedule: specs.Schedule, instant: datetime.datetime) -> Occurrence | None:
    """The highest-precedence window occurrence covering `instant`, if any."""
    instant = instant.astimezone(datetime.UTC)
    local_day = instant.astimezone(schedule.zone).date()
    # A window that started yesterday may cross midnight into today.
    covering = [
        occurrence
        for day in (local_day - _ONE_DAY, local_day)
        for occurrence in occurrences_on(schedule, day)
        if occurrence.covers(instant)
    ]
    return min(covering, key=lambda o: o.window_index, default=None)


def profile_at(schedule: specs.Schedule, instant: datetime.datetime) -> str | None:
    """The profile the schedule asks for at `instant`; None where no window applies."""
    occurrence = active_occurrence(schedule, instant)
    return occurrence.window.profile if occurrence else None


def _boundaries_from(
    schedule: specs.Schedule, instant: datetime.datetime
) -> Iterator[datetime.datetime]:
    """Every window start and end after `instant`, in time order (repeats possible)."""
    instant = instant.astimezone(datetime.UTC)
    day = instant.astimezone(schedule.zone).date() - _ONE_DAY
    pending: list[datetime.datetime] = []
    for _ in range(LOOKAHEAD_DAYS):
        for occurrence in occurrences_on(schedule, day):
            for edge in (occurrence.starts, occurrence.ends):
                if edge > instant:
                    heapq.heappush(pending, edge)
        day += _ONE_DAY
        # Windows of later dates start at or after this date's midnight, so every edge before
        # it is final; a window crossing midnight keeps its end pending until then.
        horizon = _wall_clock(day, "00:00", schedule.zone)
        while pending and pending[0] < horizon:
            yield heapq.heappop(pending)
    yield from sorted(pending)


def next_change(
    schedule: specs.Schedule, instant: datetime.datetime
) -> tuple[datetime.datetime, str | None] | None:
    """When the schedule's profile next differs from now, and what it becomes (None: no window).

    None when it does not change within the lookahead."""
    current = profile_at(schedule, instant)
    for boundary in _boundaries_from(schedule, instant):
        upcoming = profile_at(schedule, boundary)
        if upcoming != current:
            return boundary, upcoming
    return None


def describe(occurrence: Occurrence, schedule: specs.Schedule) -> str:
    """A short human account of a window occurrence, for reasons."""
    window = occurrence.window
    days = ",".join(window.days) if len(window.days) < 7 else "daily"
    text = (
        f"window #{occurrence.window_index + 1} ({days} {window.start}-{window.end} "
        f"{schedule.timezone}) on {occurrence.day.isoformat()}"
    )
    if occurrence.clipped_by_session:
        closes = occurrence.ends.astimezone(schedule.zone).strftime("%H:%M")
        opens = occurrence.starts.astimezone(schedule.zone).strftime("%H:%M")
        text += f", clipped to the {schedule.calendar} session {opens}-{closes}"
    return text
