"""The shared Triton clients: one per server, closed once no policy holds it, and left alone
for a while after the server stopped answering."""

from __future__ import annotations

import asyncio

import pytest

from batchpilot.applying import backoffs, fleets
from batchpilot_triton import servers

# Nothing listens on the discard port of loopback: connections are refused at once.
NOBODY = ("http://127.0.0.1:9", "http://127.0.0.2:9")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_client_stays_open_while_any_policy_holds_its_server() -> None:
    fleet = fleets.TritonFleet(request_timeout=1.0)
    await fleet.hold("a", [NOBODY[0]])
    await fleet.hold("b", NOBODY)
    shared = fleet.server(NOBODY[0])
    await fleet.release("b")
    assert fleet.server(NOBODY[0]) is shared, "policy a still governs it"
    await fleet.release("a")
    assert fleet.server(NOBODY[0]) is not shared, "nobody held it: it was closed"
    await fleet.close()


async def test_policies_releasing_the_same_servers_at_once_both_succeed() -> None:
    fleet = fleets.TritonFleet(request_timeout=1.0)
    for holder in ("a", "b"):
        await fleet.hold(holder, NOBODY)
    for url in NOBODY:
        with pytest.raises(servers.Unreachable):
            await fleet.loaded_models(url)  # opens the server's client
    await asyncio.gather(fleet.release("a"), fleet.release("b"))
    await fleet.close()


async def test_an_unreachable_server_is_not_asked_again_until_its_backoff_runs_out() -> None:
    clock = Clock()
    fleet = fleets.TritonFleet(request_timeout=1.0, clock=clock)
    await fleet.hold("a", NOBODY[:1])
    with pytest.raises(servers.Unreachable) as first:
        await fleet.loaded_models(NOBODY[0])
    assert not isinstance(first.value, backoffs.BackingOff)
    clock.now += 0.5
    with pytest.raises(backoffs.BackingOff) as waiting:
        await fleet.loaded_models(NOBODY[0])
    assert waiting.value.message == first.value.message, "a standing problem reads the same"
    assert waiting.value.retry_in == pytest.approx(0.5)
    clock.now += 0.5
    with pytest.raises(servers.Unreachable) as again:
        await fleet.loaded_models(NOBODY[0])
    assert not isinstance(again.value, backoffs.BackingOff), "asked again after 1 s"
    clock.now += 1.0
    with pytest.raises(backoffs.BackingOff):
        await fleet.loaded_models(NOBODY[0])  # the second failure doubled the wait
    await fleet.close()


def test_backoff_doubles_up_to_its_cap_and_a_success_resets_it() -> None:
    backoff = backoffs.Backoff(first=1.0, cap=8.0)
    assert [backoff.failed(0.0) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.waiting(3.0) == 5.0
    backoff.succeeded()
    assert backoff.waiting(0.0) == 0.0
    assert backoff.failed(0.0) == 1.0
