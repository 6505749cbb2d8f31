"""The clients' open loop, with a sender that needs no network."""

import asyncio

from batchpilot_harness import loadgen
from batchpilot_testbed import clients


class Flaky:
    """Succeeds, fails every third request, and takes 20 ms."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self) -> tuple[str | None, str | None]:
        self.sent += 1
        fails = self.sent % 3 == 0
        await asyncio.sleep(0.02)
        return ("HTTP 503: busy" if fails else None), "pod-a"

    async def close(self) -> None:
        pass


def test_open_loop_sends_poisson_arrivals_until_stopped_and_records_each() -> None:
    sender = Flaky()

    async def run() -> list[loadgen.RequestRecord]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.call_later(1.0, stop.set)
        return await clients.open_loop(
            sender, rate=200, seed=3, origin=loop.time() + 0.05, stop=stop
        )

    records = asyncio.run(run())
    assert 120 <= len(records) <= 280  # 200/s for about a second
    assert len(records) == sender.sent
    assert [r.scheduled for r in records] == sorted(r.scheduled for r in records)
    assert records[-1].scheduled < 1.0
    failed = [r for r in records if not r.succeeded]
    assert len(failed) == len(records) // 3
    assert all(r.error == "HTTP 503: busy" and r.server == "pod-a" for r in failed)
    assert all(r.latency is not None and r.latency >= 0.02 for r in records)
    lags = [r.sent - r.scheduled for r in records if r.sent is not None]
    assert max(lags) < 0.1, "arrivals were sent late"
