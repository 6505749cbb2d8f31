"""Durations as users write them in a policy (`90s`, `5m`, `1h30m`), and instants as reasons
show them."""

from __future__ import annotations

import datetime
import re

# The CRD carries the same pattern, so the API server and this parser agree on what is valid.
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
_DURATION = re.compile(r"^(?:(?P<h>[0-9]+)h)?(?:(?P<m>[0-9]+)m)?(?:(?P<s>[0-9]+)s)?$")


def parse_duration(text: str) -> int:
    """Seconds in a duration such as `1h30m`; raises ValueError on anything else."""
    match = _DURATION.match(text)
    if not text or match is None:
        raise ValueError(f"{text!r} is not a duration like 90s, 5m or 1h30m")
    hours, minutes, seconds = (int(match.group(unit) or 0) for unit in ("h", "m", "s"))
    return hours * 3600 + minutes * 60 + seconds


def format_duration(seconds: float) -> str:
    """The shortest readable form of a duration, for reasons and logs."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [
        f"{hours}h" if hours else "",
        f"{minutes}m" if minutes else "",
        f"{secs}s" if secs else "",
    ]
    return "".join(parts)


def format_instant(instant: datetime.datetime) -> str:
    """An instant for reasons, in UTC as the status's times are: `2026-11-24T15:00:05Z`. Reasons
    name instants, not ages, so a status stays still while nothing changes."""
    utc = instant.astimezone(datetime.UTC).replace(microsecond=0)
    return utc.isoformat().replace("+00:00", "Z")
