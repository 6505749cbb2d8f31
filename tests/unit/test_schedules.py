"""The clock side of a policy: windows in local time, DST, midnight, exceptions, calendars."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchpilot.api import calendar_names, documents
from batchpilot.api.v1alpha1 import specs
from batchpilot.policy import calendars, schedules
from builders import NEW_YORK, make_spec, market_hours, ny, utc, window


def schedule_of(**fields: object) -> specs.Schedule:
    spec = make_spec(schedule=fields)
    assert spec.schedule is not None
    return spec.schedule


def test_window_applies_in_local_time_on_its_weekdays() -> None:
    schedule = schedule_of(**market_hours())
    assert schedules.profile_at(schedule, ny(2026, 11, 24, 9, 29)) is None
    assert schedules.profile_at(schedule, ny(2026, 11, 24, 9, 30)) == "interactive"
    assert schedules.profile_at(schedule, ny(2026, 11, 24, 15, 59, 59)) == "interactive"
    assert schedules.profile_at(schedule, ny(2026, 11, 24, 16, 0)) is None
    assert schedules.profile_at(schedule, ny(2026, 11, 28, 12, 0)) is None  # Saturday


def test_dst_start_week_keeps_local_opening_time() -> None:
    # Clocks spring forward on Sunday 2026-03-08: 09:30 is 14:30Z before and 13:30Z after.
    schedule = schedule_of(**market_hours())
    assert schedules.profile_at(schedule, utc(2026, 3, 6, 14, 30)) == "interactive"
    assert schedules.profile_at(schedule, utc(2026, 3, 9, 13, 29)) is None
    assert schedules.profile_at(schedule, utc(2026, 3, 9, 13, 30)) == "interactive"
    assert schedules.next_change(schedule, ny(2026, 3, 7, 12)) == (
        utc(2026, 3, 9, 13, 30),
        "interactive",
    )


def test_dst_end_week_keeps_local_opening_time() -> None:
    # Clocks fall back on Sunday 2026-11-01: 09:30 is 13:30Z before and 14:30Z after.
    schedule = schedule_of(**market_hours())
    assert schedules.profile_at(schedule, utc(2026, 10, 30, 13, 30)) == "interactive"
    assert schedules.next_change(schedule, ny(2026, 10, 31, 12)) == (
        utc(2026, 11, 2, 14, 30),
        "interactive",
    )
    assert schedules.next_change(schedule, ny(2026, 11, 2, 10)) == (utc(2026, 11, 2, 21, 0), None)


def test_window_on_the_skipped_hour_starts_when_clocks_resume() -> None:
    schedule = schedule_of(
        timezone="America/New_York",
        windows=[window("interactive", "02:30", "05:00", days=["Sun"])],
    )
    # 02:30 does not exist on 2026-03-08; the window opens at 03:30 EDT (07:30Z).
    assert schedules.next_change(schedule, ny(2026, 3, 8, 0)) == (
        utc(2026, 3, 8, 7, 30),
        "interactive",
    )


def test_night_window_over_the_fall_back_lasts_an_extra_hour() -> None:
    schedule = schedule_of(
        timezone="America/New_York",
        windows=[window("interactive", "00:00", "03:00", days=["Sun"])],
    )
    occurrence = schedules.active_occurrence(schedule, ny(2026, 11, 1, 0, 30))
    assert occurrence is not None
    assert occurrence.ends - occurrence.starts == datetime.timedelta(hours=4)


def test_window_across_midnight_belongs_to_the_day_it_starts() -> None:
    schedule = schedule_of(
        timezone="America/New_York",
        windows=[window("interactive", "22:00", "02:00", days=["Fri"])],
    )
    assert schedules.profile_at(schedule, ny(2026, 11, 27, 21, 59)) is None
    assert schedules.profile_at(schedule, ny(2026, 11, 27, 23, 0)) == "interactive"
    assert schedules.profile_at(schedule, ny(2026, 11, 28, 1, 59)) == "interactive"  # Saturday
    assert schedules.profile_at(schedule, ny(2026, 11, 28, 2, 0)) is None
    assert schedules.profile_at(schedule, ny(2026, 11, 28, 23, 0)) is None  # Sat does not start one
    assert schedules.next_change(schedule, ny(2026, 11, 27, 23)) == (ny(2026, 11, 28, 2), None)


def test_window_keeps_interactive_until_end_of_day_with_2400() -> None:
    schedule = schedule_of(
        timezone="UTC", windows=[window("interactive", "18:00", "24:00", days=["Mon"])]
    )
    assert schedules.profile_at(schedule, utc(2026, 11, 23, 23, 59, 59)) == "interactive"
    assert schedules.next_change(schedule, utc(2026, 11, 23, 19)) == (utc(2026, 11, 24), None)


def test_exception_date_suppresses_windows_that_start_on_it() -> None:
    schedule = schedule_of(
        timezone="America/New_York",
        windows=[window("interactive", "20:00", "10:00", days=["Wed", "Thu"])],
        exceptions=["2026-12-24"],
    )
    # Wednesday's overnight window still runs into the morning of the exception date ...
    assert schedules.profile_at(schedule, ny(2026, 12, 24, 9)) == "interactive"
    # ... but none starts on it.
    assert schedules.profile_at(schedule, ny(2026, 12, 24, 21)) is None
    assert schedules.next_change(schedule, ny(2026, 12, 24, 12)) == (
        ny(2026, 12, 30, 20),
        "interactive",
    )


def test_xnys_holiday_has_no_session() -> None:
    schedule = schedule_of(**market_hours(calendar="XNYS"))
    assert schedules.profile_at(schedule, ny(2026, 11, 26, 11)) is None  # Thanksgiving
    assert schedules.next_change(schedule, ny(2026, 11, 26, 11)) == (
        ny(2026, 11, 27, 9, 30),
        "interactive",
    )


def test_xnys_early_close_clips_the_window() -> None:
    schedule = schedule_of(**market_hours(calendar="XNYS"))
    assert schedules.profile_at(schedule, ny(2026, 11, 27, 12, 59)) == "interactive"
    assert schedules.profile_at(schedule, ny(2026, 11, 27, 13, 0)) is None
    assert schedules.next_change(schedule, ny(2026, 11, 27, 10)) == (ny(2026, 11, 27, 13), None)
    occurrence = schedules.active_occurrence(schedule, ny(2026, 11, 27, 10))
    assert occurrence is not None
    assert occurrence.clipped_by_session


def test_calendar_clips_a_window_that_starts_before_the_open() -> None:
    schedule = schedule_of(
        timezone="America/New_York",
        calendar="XNYS",
        windows=[window("interactive", "08:00", "18:00")],
    )
    assert schedules.profile_at(schedule, ny(2026, 11, 24, 9)) is None
    assert schedules.next_change(schedule, ny(2026, 11, 24, 8)) == (
        ny(2026, 11, 24, 9, 30),
        "interactive",
    )
    assert schedules.next_change(schedule, ny(2026, 11, 24, 10)) == (ny(2026, 11, 24, 16), None)


def test_first_window_in_the_list_wins_where_windows_overlap() -> None:
    schedule = schedule_of(
        timezone="UTC",
        windows=[window("bulk", "12:00", "13:00"), window("interactive", "09:00", "17:00")],
    )
    assert schedules.profile_at(schedule, utc(2026, 11, 24, 12, 30)) == "bulk"
    assert schedules.profile_at(schedule, utc(2026, 11, 24, 11)) == "interactive"
    assert schedules.next_change(schedule, utc(2026, 11, 24, 11)) == (utc(2026, 11, 24, 12), "bulk")


def test_adjacent_windows_of_one_profile_are_no_change() -> None:
    schedule = schedule_of(
        timezone="UTC",
        windows=[
            window("interactive", "00:00", "12:00", days=["Mon"]),
            window("interactive", "12:00", "24:00", days=["Mon"]),
        ],
    )
    assert schedules.next_change(schedule, utc(2026, 11, 23, 1)) == (utc(2026, 11, 24), None)


def test_no_windows_never_change() -> None:
    assert schedules.next_change(schedule_of(timezone="UTC"), utc(2026, 11, 24)) is None


def test_zone_is_the_iana_zone() -> None:
    assert schedule_of(**market_hours()).zone == NEW_YORK


def test_the_policy_core_loads_exchange_calendars_only_for_a_policy_that_names_one() -> None:
    # The runner must start where exchange-calendars (and pandas) are not installed.
    script = (
        "import sys\n"
        "from batchpilot import running\n"
        "from builders import make_spec, market_hours\n"
        "make_spec(schedule=market_hours())\n"
        "assert 'exchange_calendars' not in sys.modules and 'pandas' not in sys.modules\n"
        "make_spec(schedule=market_hours(calendar='XNYS'))\n"
        "assert 'exchange_calendars' in sys.modules\n"
    )
    tests = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), *sys.path])}
    subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=30)


def test_a_calendar_without_its_library_is_a_validation_error_that_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unavailable(name: str) -> bool:
        raise calendars.CalendarsUnavailable("exchange calendars need the exchange-calendars ...")

    monkeypatch.setattr(calendar_names, "is_known", unavailable)
    with pytest.raises(
        documents.PolicyError,
        match=re.escape("spec.schedule.calendar: calendar 'XNYS': exchange calendars need the"),
    ):
        schedule_of(**market_hours(calendar="XNYS"))
