"""Exponential backoff: how long to leave something alone after it failed in a row.

One policy serves everything that retries: a Triton server that does not answer (so one dead
replica costs neither a timeout per tick nor a stalled rollout) and the operator's reconcile
loop after an unexpected error.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_triton import servers

FIRST_SECONDS = 1.0
MAX_SECONDS = 60.0


@dataclass
class Backoff:
    """1, 2, 4, ... seconds after consecutive failures, at most `cap`; a success resets it."""

    first: float = FIRST_SECONDS
    cap: float = MAX_SECONDS
    failures: int = 0
    retry_at: float = 0.0
    """Monotonic seconds before which it is not tried again."""

    def failed(self, now: float) -> float:
        """Count a failure at `now`; the seconds to wait before the next try."""
        self.failures += 1
        delay = min(self.first * 2.0 ** (self.failures - 1), self.cap)
        self.retry_at = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def waiting(self, now: float) -> float:
        """Seconds left before the next try; 0 when it may be tried now."""
        return max(self.retry_at - now, 0.0)


class BackingOff(servers.Unreachable):
    """A server that did not answer lately, not asked again until its backoff runs out. The
    message is the last failure's, so a standing problem reads the same every tick."""

    def __init__(self, url: str, message: str, *, retry_in: float) -> None:
        super().__init__(url, message)
        self.retry_in = retry_in
