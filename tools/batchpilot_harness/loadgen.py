"""Open-loop load for a Triton model over the KServe v2 HTTP protocol.

Arrivals form a Poisson process whose rate is constant within each phase of a schedule. They are
drawn in advance from a seed, and each request is sent when it is due whether or not earlier ones
have returned: a closed loop would slow down exactly when the server does and hide the queueing
that dynamic batching is about. A bound on requests in flight keeps a stalled server from using up
sockets and memory; an arrival that finds the bound reached is not sent, and is counted as such.

Requests go to one server, or each to the one an `Endpoint` picks when it is due (a client-side
load balancer: `batchpilot_testbed.balancing`). Used by the demo, the integration tests, the
benchmarks and the e2e tests, and runnable as
`python -m batchpilot_harness.loadgen --url URL --model NAME --phase RATE:SECONDS ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Sequence

import aiohttp
import numpy as np

_NUMPY_DATATYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
# Error bodies are kept in the records, shortened.
_ERROR_TEXT_LIMIT = 300
# The scheduler starts this long after the call, so the first arrivals are not already late.
_START_LEAD_SECONDS = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase:
    """`seconds` of Poisson arrivals at `rate` requests per second (0: silence)."""

    rate: float
    seconds: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.seconds <= 0:
            raise ValueError(f"a phase needs rate >= 0 and seconds > 0, not {self}")

    @classmethod
    def parse(cls, text: str) -> Phase:
        """`RATE:SECONDS`, e.g. `800:10`."""
        rate, separator, seconds = text.partition(":")
        if not separator:
            raise ValueError(f"expected RATE:SECONDS, got {text!r}")
        return cls(rate=float(rate), seconds=float(seconds))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arrival:
    phase: int
    offset: float  # seconds after the start of the schedule


def poisson_arrivals(phases: Sequence[Phase], *, seed: int) -> list[Arrival]:
    generator = np.random.default_rng(seed)
    arrivals: list[Arrival] = []
    phase_start = 0.0
    for index, phase in enumerate(phases):
        if phase.rate > 0:
            # Comfortably more gaps than the phase needs; the surplus is cut off below.
            expected = phase.rate * phase.seconds
            count = int(expected + 10 * expected**0.5 + 10)
            offsets = np.cumsum(generator.exponential(1.0 / phase.rate, size=count))
            arrivals.extend(
                Arrival(phase=index, offset=phase_start + float(offset))
                for offset in offsets[offsets < phase.seconds]
            )
        phase_start += phase.seconds
    return arrivals


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferencePayload:
    """One serialised KServe v2 inference request body, sent as is for every arrival."""

    model: str
    body: bytes

    @classmethod
    def for_input(
        cls,
        *,
        model: str,
        input_name: str,
        datatype: str,
        shape: Sequence[int],
        seed: int = 0,
    ) -> InferencePayload:
        """Random values of the right type and shape (shape includes the batch dimension)."""
        if datatype not in _NUMPY_DATATYPES:
            raise ValueError(f"cannot generate data of type {datatype}")
        values = np.random.default_rng(seed).uniform(-1.0, 1.0, size=tuple(shape))
        data = values.round(4).astype(_NUMPY_DATATYPES[datatype]).ravel().tolist()
        body = {
            "inputs": [
                {"name": input_name, "shape": list(shape), "datatype": datatype, "data": data}
            ]
        }
        return cls(model=model, body=json.dumps(body).encode())


async def payload_from_metadata(
    session: aiohttp.ClientSession, base_url: str, model: str, *, batch_size: int = 1
) -> InferencePayload:
    """A payload for a model with one input, shaped from the server's model metadata."""
    async with session.get(f"{base_url}/v2/models/{model}") as response:
        response.raise_for_status()
        metadata = await response.json()
    inputs = metadata["inputs"]
    if len(inputs) != 1:
        raise ValueError(f"model {model} has {len(inputs)} inputs; build its payload by hand")
    (only_input,) = inputs
    dims = [int(d) for d in only_input["shape"]]
    # A batching model reports its batch dimension as the leading -1.
    shape = [batch_size if i == 0 and d == -1 else max(d, 1) for i, d in enumerate(dims)]
    return InferencePayload.for_input(
        model=model, input_name=only_input["name"], datatype=only_input["datatype"], shape=shape
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """What happened to one arrival; times are seconds after the start of the schedule."""

    phase: int
    scheduled: float
    sent: float | None  # None: not sent, for the reason in `error`
    latency: float | None  # from sending to the end of the response; None without a response
    status: int | None  # HTTP status; None when not sent or when the connection failed
    error: str | None = None
    server: str | None = None
    """The base URL it was sent to; None when not sent."""

    @property
    def succeeded(self) -> bool:
        return self.status == 200


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadSummary:
    scheduled: int
    sent: int
    not_sent: int
    succeeded: int
    failed: int  # sent, but no 200 response
    seconds: float
    offered_rate: float  # scheduled per second
    achieved_rate: float  # succeeded per second
    latency_p50_ms: float | None  # of successful requests
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None
    max_send_lag_ms: float  # how late the scheduler sent its most delayed request

    @classmethod
    def of(cls, records: Sequence[RequestRecord], *, seconds: float) -> LoadSummary:
        sent = [r for r in records if r.sent is not None]
        latencies_ms = np.array([r.latency for r in sent if r.succeeded], dtype=float) * 1000.0
        percentiles: list[float | None] = (
            [float(p) for p in np.percentile(latencies_ms, [50, 95, 99, 100])]
            if latencies_ms.size
            else [None] * 4
        )
        succeeded = int(latencies_ms.size)
        lags = [r.sent - r.scheduled for r in sent if r.sent is not None]
        return cls(
            scheduled=len(records),
            sent=len(sent),
            not_sent=len(records) - len(sent),
            succeeded=succeeded,
            failed=len(sent) - succeeded,
            seconds=seconds,
            offered_rate=len(records) / seconds,
            achieved_rate=succeeded / seconds,
            latency_p50_ms=percentiles[0],
            latency_p95_ms=percentiles[1],
            latency_p99_ms=percentiles[2],
            latency_max_ms=percentiles[3],
            max_send_lag_ms=max(lags, default=0.0) * 1000.0,
        )

    def describe(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"

        return (
            f"{self.succeeded}/{self.scheduled} ok, {self.failed} failed, "
            f"{self.not_sent} not sent; "
            f"{self.achieved_rate:.0f}/{self.offered_rate:.0f} req/s; latency ms p50 "
            f"{ms(self.latency_p50_ms)} p95 {ms(self.latency_p95_ms)} p99 "
            f"{ms(self.latency_p99_ms)} max {ms(self.latency_max_ms)}; "
            f"send lag max {self.max_send_lag_ms:.1f} ms"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadResult:
    phases: tuple[Phase, ...]
    records: tuple[RequestRecord, ...]

    def summary(self, phase: int | None = None) -> LoadSummary:
        """The whole run, or one phase of it."""
        if phase is None:
            return LoadSummary.of(self.records, seconds=sum(p.seconds for p in self.phases))
        return LoadSummary.of(
            [r for r in self.records if r.phase == phase], seconds=self.phases[phase].seconds
        )


Endpoint = Callable[[], str | None]
"""Picks the base URL of a request when it is due, as a load balancer does; None: nowhere."""


async def run_load(
    *,
    base_url: str | Endpoint,
    payload: InferencePayload,
    phases: Sequence[Phase],
    seed: int = 0,
    max_in_flight: int = 512,
    request_timeout: float = 30.0,
    session: aiohttp.ClientSession | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    start: float | None = None,
) -> LoadResult:
    """Send the schedule's arrivals to `{base_url}/v2/models/{model}/infer`; wait for them all.

    `base_url` may be an `Endpoint` that picks one for each request (`batchpilot_testbed.balancing`
    does). `start` is the event loop's time at offset 0 of the schedule, by default a moment from
    now.
    `on_record` sees each request's record as soon as it is complete, for live views."""
    arrivals = poisson_arrivals(phases, seed=seed)
    run = functools.partial(
        _run,
        endpoint=base_url if callable(base_url) else lambda: base_url,
        start=start,
        payload=payload,
        phases=phases,
        arrivals=arrivals,
        max_in_flight=max_in_flight,
        request_timeout=request_timeout,
        on_record=on_record,
    )
    if session is None:
        connector = aiohttp.TCPConnector(limit=max_in_flight)
        async with aiohttp.ClientSession(connector=connector) as own_session:
            return await run(own_session)
    return await run(session)


async def _run(
    session: aiohttp.ClientSession,
    *,
    endpoint: Endpoint,
    start: float | None,
    payload: InferencePayload,
    phases: Sequence[Phase],
    arrivals: Sequence[Arrival],
    max_in_flight: int,
    request_timeout: float,
    on_record: Callable[[RequestRecord], None] | None,
) -> LoadResult:
    loop = asyncio.get_running_loop()
    path = f"/v2/models/{payload.model}/infer"
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    records: list[RequestRecord | None] = [None] * len(arrivals)
    in_flight: set[asyncio.Task[None]] = set()
    origin = loop.time() + _START_LEAD_SECONDS if start is None else start

    async def send(index: int, arrival: Arrival, base_url: str) -> None:
        sent = loop.time() - origin
        status: int | None = None
        error: str | None = None
        try:
            async with session.post(
                f"{base_url}{path}", data=payload.body, headers=headers, timeout=timeout
            ) as response:
                body = await response.read()
                status = response.status
                if status != 200:
                    error = body[:_ERROR_TEXT_LIMIT].decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as failure:
            error = f"{type(failure).__name__}: {failure}"
        finished = loop.time() - origin
        record = RequestRecord(
            phase=arrival.phase,
            scheduled=arrival.offset,
            sent=sent,
            latency=finished - sent if status is not None else None,
            status=status,
            # Which server failed, where there are several.
            error=None if error is None else f"{base_url}: {error}"[:_ERROR_TEXT_LIMIT],
            server=base_url,
        )
        records[index] = record
        if on_record is not None:
            on_record(record)

    def not_sent(arrival: Arrival, reason: str) -> RequestRecord:
        return RequestRecord(
            phase=arrival.phase,
            scheduled=arrival.offset,
            sent=None,
            latency=None,
            status=None,
            error=reason,
        )

    for index, arrival in enumerate(arrivals):
        delay = origin + arrival.offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(in_flight) >= max_in_flight:
            records[index] = not_sent(arrival, f"{max_in_flight} requests in flight already")
            continue
        base_url = endpoint()
        if base_url is None:
            records[index] = not_sent(arrival, "no endpoint to send it to")
            continue
        task = asyncio.create_task(send(index, arrival, base_url))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    # Silence at the end of the schedule is part of it, like silence anywhere else.
    remaining = origin + sum(p.seconds for p in phases) - loop.time()
    if remaining > 0:
        await asyncio.sleep(remaining)
    await asyncio.gather(*in_flight)
    complete = [r for r in records if r is not None]
    assert len(complete) == len(records)
    return LoadResult(phases=tuple(phases), records=tuple(complete))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_harness.loadgen",
        description="Open-loop Poisson load on one Triton model (KServe v2 HTTP, JSON).",
    )
    parser.add_argument("--url", required=True, help="Triton's HTTP endpoint, http://HOST:PORT")
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--phase",
        type=Phase.parse,
        action="append",
        required=True,
        dest="phases",
        help="RATE:SECONDS, repeat for a piecewise schedule",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="inferences per request")
    parser.add_argument("--max-in-flight", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    return parser


async def _main(arguments: argparse.Namespace) -> None:
    url = arguments.url.rstrip("/")
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=arguments.max_in_flight)
    ) as session:
        payload = await payload_from_metadata(
            session, url, arguments.model, batch_size=arguments.batch_size
        )
        result = await run_load(
            base_url=url,
            payload=payload,
            phases=arguments.phases,
            seed=arguments.seed,
            max_in_flight=arguments.max_in_flight,
            session=session,
        )
    summaries = {
        **{f"phase {i} ({p.rate:g}/s)": result.summary(i) for i, p in enumerate(result.phases)},
        "total": result.summary(),
    }
    for name, summary in summaries.items():
        if arguments.json:
            print(json.dumps({"name": name, **dataclasses.asdict(summary)}))
        else:
            print(f"{name}: {summary.describe()}")


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(_main(_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
