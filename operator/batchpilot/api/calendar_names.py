"""Which exchange calendars exist, from the maintained `exchange_calendars` library: what the
API checks a policy's `calendar` against. The sessions themselves are the policy core's
(`batchpilot.policy.calendars`).

The library (and pandas under it, about 100 MB installed) is imported when a policy first names a
calendar: the standalone runner and the operator run policies without one on machines that do
not carry it (a GPU machine reached only by copying wheels). A policy that names a calendar where
the library is missing fails validation with that reason.
"""

from __future__ import annotations

import functools
from typing import Any


class CalendarsUnavailable(RuntimeError):
    """The `exchange-calendars` library is not installed."""


@functools.cache
def library() -> Any:
    try:
        import exchange_calendars
    except ImportError as error:
        raise CalendarsUnavailable(
            "exchange calendars need the exchange-calendars package, which is not installed "
            "here (the operator's image leaves it out: install batchpilot[calendars], or build "
            "the image with --build-arg OPERATOR_REQUIREMENTS=requirements/operator-calendars.txt;"
            f" {error})"
        ) from None
    return exchange_calendars


@functools.cache
def known_names() -> frozenset[str]:
    return frozenset(library().get_calendar_names(include_aliases=True))


def is_known(name: str) -> bool:
    return name in known_names()
