"""What a hostile tenant runs in its Pod: servers that answer every request, but badly.

A policy author controls the Pods a policy selects and the Prometheus URL it names, so the operator
must survive whatever answers there. This module plays that tenant in a Pod of the local cluster's
real node (test_isolation mounts it from a ConfigMap), on the ports the operator reads:

- **flood**: Triton's HTTP and metrics ports and the sidecar's port answer every request with a
  200 and `FLOOD_BYTES` of a JSON string that never ends (no memory is held to send it);
- **trickle**: Prometheus' port answers with a 200 and then one byte every `TRICKLE_SECONDS`, so
  that every socket read succeeds and only a deadline on the whole response ends it.

Every response is bounded (the flood by its size, the trickle by `TRICKLE_LIMIT_SECONDS`), and
the process ends after `LIFETIME_SECONDS` in any case; deleting the Pod ends it sooner.
"""

import argparse
import asyncio
import contextlib
from collections.abc import Sequence

from batchpilot_triton import endpoints

FLOOD_BYTES = 500 * 1024 * 1024
FLOOD_CHUNK = b"a" * (1024 * 1024)
TRICKLE_SECONDS = 0.5
TRICKLE_LIMIT_SECONDS = 600.0
LIFETIME_SECONDS = 1800.0
PROMETHEUS_PORT = 9090
FLOOD_PORTS = (
    endpoints.TRITON_HTTP_PORT,
    endpoints.TRITON_METRICS_PORT,
    endpoints.SIDECAR_PORT,
)
MAX_REQUEST_HEAD = 64 * 1024


async def _read_request_head(reader: asyncio.StreamReader) -> bool:
    """Read one request's head (its body, if any, is ignored); False once the client is gone."""
    with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        head = await reader.readuntil(b"\r\n\r\n")
        return len(head) <= MAX_REQUEST_HEAD
    return False


def _head(length: int, content_type: str) -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


async def _flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        if not await _read_request_head(reader):
            return
        # A JSON string (or a metrics page's comment) that is still open when the bytes end.
        writer.write(_head(FLOOD_BYTES, "application/json") + b'{"models": "')
        sent = len(b'{"models": "')
        while sent < FLOOD_BYTES:
            chunk = FLOOD_CHUNK[: FLOOD_BYTES - sent]
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    try:
        if not await _read_request_head(reader):
            return
        writer.write(_head(1024 * 1024, "application/json") + b"{")
        await writer.drain()
        ends = loop.time() + TRICKLE_LIMIT_SECONDS
        while loop.time() < ends:
            await asyncio.sleep(TRICKLE_SECONDS)
            writer.write(b" ")
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(host: str, *, lifetime: float) -> None:
    servers = [await asyncio.start_server(_flood, host, port) for port in FLOOD_PORTS]
    servers.append(await asyncio.start_server(_trickle, host, PROMETHEUS_PORT))
    try:
        await asyncio.sleep(lifetime)
    finally:
        for server in servers:
            server.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--lifetime", type=float, default=LIFETIME_SECONDS)
    arguments = parser.parse_args(argv)
    asyncio.run(serve(arguments.host, lifetime=arguments.lifetime))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
