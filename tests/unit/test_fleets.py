"""The operator's shared Triton clients: one per server, closed once nobody targets it."""

from __future__ import annotations

import asyncio

import pytest

from batchpilot.applying import fleets
from batchpilot_triton import servers

# Nothing listens on the discard port of loopback: connections are refused at once.
NOBODY = ("http://127.0.0.1:9", "http://127.0.0.2:9")


async def test_two_reconciles_forgetting_the_same_servers_at_once_both_succeed() -> None:
    fleet = fleets.TritonFleet(request_timeout=1.0)
    for url in NOBODY:
        with pytest.raises(servers.Unreachable):
            await fleet.loaded_models(url)  # opens the server's client
    await asyncio.gather(fleet.forget_all_but([]), fleet.forget_all_but([NOBODY[0]]))
    kept = fleet.server(NOBODY[0])
    await fleet.forget_all_but([NOBODY[0]])
    assert fleet.server(NOBODY[0]) is kept
    await fleet.close()
