"""Reading answers from servers a policy author names: every read bounded, every error summarised.

The operator serves every namespace from one process (256 MiB), so nothing a policy points it
at may hold it for long, fill its memory, or have its words repeated where others read them.
Triton servers and sidecars are Pods of the policy's namespace and Prometheus is any URL the
policy gives; each of them may be slow, huge or hostile. So every read here has:

- a total deadline, connect, headers and body together (asyncio cancels the whole request; a
  per-read socket timeout would let a server that trickles a byte a second hold it forever);
- a size cap, checked as the body arrives, so a server streaming without end is cut off after
  the cap, not after it has filled memory;
- errors as a status and a reason: an error answer's body, or the bytes aiohttp's parser choked
  on, never reach a condition, an event or a log line (a server that quotes back a request
  header would otherwise hand a policy's author the credential that header carried);
- no redirect followed (`client_session`): a server may not send the operator, or the headers
  it carries, on to an address of its choosing.

The defaults below are the documented ones (README, "Bounded reads").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http
import socket
import types
from typing import Any

import aiohttp
import aiohttp.abc

KIB = 1024
MIB = 1024 * KIB

TRITON_DEADLINE_SECONDS = 5.0
"""A Triton call other than a model load or unload (those run under the load timeout)."""
SIDECAR_DEADLINE_SECONDS = 2.0
"""One sidecar's /status."""
ENGINE_ARGUMENTS_DEADLINE_SECONDS = 5.0
"""A model's engine arguments from the sidecar beside a Pod."""
PROMETHEUS_DEADLINE_SECONDS = 4.0
"""All of a policy's queries to its Prometheus in one tick (within the tick's 5-s signal budget)."""

METRICS_PAGE_BYTES = 4 * MIB
"""Triton's metrics page (about 100 bytes a series)."""
METRICS_PAGE_LINES = 20_000
"""The most lines of a metrics page the operator parses: parsing takes about 1.3 KiB of memory
a series, so a page of short lines under the byte cap could otherwise take 100 MiB or more.
About 150 series a model with an LLM engine's histograms, 25 without: room for 130 to 800."""
TRITON_JSON_BYTES = 4 * MIB
"""Triton's JSON answers: a model config, the repository index, statistics, an error."""
STATUS_BYTES = 2 * MIB
"""A sidecar's /status document (a few KiB a model)."""
ENGINE_ARGUMENTS_BYTES = 1 * MIB
"""A model's engine arguments (its model.json) from a sidecar."""
PROMETHEUS_BYTES = 1 * MIB
"""One Prometheus query's answer (batchpilot's queries reduce to one number each)."""
INLINE_PARSE_CHARS = 256 * KIB
"""A metrics page longer than this is parsed off the event loop (about 0.1 s of parsing)."""
LARGE_PAGE_PARSES = 2
"""Large pages parsed at once in the whole process, whatever their servers: memory over speed."""
READS_AT_ONCE = 8
"""A policy's reads of its servers in flight at once: with the caps, what one policy's
signals can hold in memory (8 sidecars' 2 MiB, or 8 metrics pages' 4 MiB)."""
ERROR_BYTES = 16 * KIB
"""What is read of an error answer, for its excerpt."""
EXCERPT_CHARS = 160
"""The most of a server's own words an error message repeats."""


class TooLarge(aiohttp.ClientPayloadError):
    """The answer is larger than its cap; it was cut off and its connection closed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the answer is larger than {size_text(limit)}; cut off there")


def size_text(size: int) -> str:
    if size % MIB == 0:
        return f"{size // MIB} MiB"
    if size % KIB == 0:
        return f"{size // KIB} KiB"
    return f"{size} bytes"


def excerpt(text: str, chars: int = EXCERPT_CHARS) -> str:
    """A server's words as one printable line of at most `chars` characters."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return line if len(line) <= chars else line[: chars - 1] + "…"


class RedirectRefused(aiohttp.ClientResponseError):
    """The server answered with a redirect, which is never followed."""


async def _refuse_redirect(
    session: aiohttp.ClientSession,
    context: types.SimpleNamespace,
    params: aiohttp.TraceRequestRedirectParams,
) -> None:
    response = params.response
    response.close()
    # Its Location is not repeated: it is the server's choice of words too.
    raise RedirectRefused(
        response.request_info,
        response.history,
        status=response.status,
        message=f"answered HTTP {response.status}, a redirect, which is not followed",
    )


def client_session(
    *, connector: aiohttp.BaseConnector | None = None, timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientSession:
    """An aiohttp session for servers a policy names: a redirect is an error (whatever a call's
    `allow_redirects`), so neither the request nor the headers it carries go anywhere else."""
    guard = aiohttp.TraceConfig()
    guard.on_request_redirect.append(_refuse_redirect)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[guard])


def client_error_text(error: BaseException) -> str:
    """What an aiohttp error may say where a policy's author reads it: a connection's failure
    in its own words, anything about an answer by its kind only (aiohttp's parser errors
    quote the answer's bytes)."""
    if isinstance(error, TooLarge):
        return str(error)
    if isinstance(error, RedirectRefused):
        return error.message
    if isinstance(error, aiohttp.ClientConnectionError) and not isinstance(
        error, aiohttp.ServerDisconnectedError
    ):
        return excerpt(str(error))
    if isinstance(error, aiohttp.ClientResponseError):
        return f"the answer could not be read ({type(error).__name__}, HTTP {error.status})"
    return f"the answer could not be read ({type(error).__name__})"


def refusal(status: int, reason: str | None = None) -> str:
    """An HTTP error answer as its status and the standard phrase for it: never its body, nor
    the reason phrase the server chose (a server may put anything there)."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP {status} {phrase}".rstrip()


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or TooLarge as soon as it passes `limit` bytes (decompressed bytes,
    where aiohttp decompresses). The caller's deadline bounds the time."""
    declared = response.content_length
    if declared is not None and declared > limit:
        response.close()
        raise TooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            response.close()
            raise TooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class OwnThreadResolver(aiohttp.abc.AbstractResolver):
    """Name lookups on one thread of their own, one at a time.

    aiohttp's default resolver runs getaddrinfo in the event loop's default thread pool, which
    the operator's Kubernetes calls use too. A lookup cannot be cancelled, so a name whose DNS
    never answers would keep taking threads from that pool, one per tick, until the
    Kubernetes calls of every policy waited behind it. Here a slow lookup holds this thread
    only, and the next lookup is refused until it ends."""

    def __init__(self) -> None:
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="batchpilot-resolver"
        )
        self._running: concurrent.futures.Future[Any] | None = None

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        if self._running is not None and not self._running.done():
            raise OSError(f"the previous lookup of {host!r} has not ended; not asked again yet")
        self._running = self._thread.submit(
            socket.getaddrinfo,
            host,
            port,
            family=family,
            type=socket.SOCK_STREAM,
            flags=socket.AI_ADDRCONFIG,
        )
        infos = await asyncio.wrap_future(self._running)
        return [
            aiohttp.abc.ResolveResult(
                hostname=host,
                host=str(address[0]),
                port=int(address[1]),
                family=found_family,
                proto=proto,
                flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            )
            for found_family, _, proto, _, address in infos
        ]

    async def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
