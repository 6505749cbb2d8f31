"""Why a reload holds requests on one Triton server: the load request's HTTP worker.

A profile switch is a reload with a config override (`POST v2/repository/models/NAME/load`).
The first GPU check saw every switch on its single server hold the requests sent meanwhile for
the whole reload (3.8-4.1 s, p99 over the switch the same), though Triton's old instances keep
serving while the new ones start. This benchmark times a reload under steady load and finds
what holds which requests:

- Triton's log (`--log-verbose=1`) gives the reload's own timeline: the load begins, the new
  instances' Python stubs start, each instance is initialised and warmed up, the new model is
  loaded and the old one finalised. The old instances execute batches all along.
- Each request's send and completion, on the same clock as the load request, says which
  requests waited and for how long.

The same reload is sent two ways, under the same HTTP load: over HTTP, as the operator and the
runner send it, and over gRPC (`tritonclient.grpc`), whose frontend handles the repository call
on threads of its own. Triton's HTTP frontend handles a load synchronously on one of its worker
threads (`--http-thread-count`, 8 by default), and a client's keep-alive connection is served by
one worker for its life: requests on the connections that share the load's worker wait for the
whole reload, the others are served by the old instances. So a client's p99 over a switch is
the reload's length whenever more than 1% of its requests ride such a connection.

    python tests/benchmarks/bench_reload.py           # gpu_sim and torch_mlp, 3 reloads each way
    python tests/benchmarks/bench_reload.py --short   # CI: one reload each way, torch_mlp only
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import benchmarking
import tritonclient.grpc.aio

from batchpilot_harness import demo_models, loadgen, local_triton
from batchpilot_triton import servers

RATE = 60.0
"""Requests per second of the steady load (open-loop, keep-alive connections)."""
SETTLE_SECONDS = 2.0
"""Load before the first reload, and after each one."""
HELD_FRACTION = 0.5
"""A request counts as held when it waited at least this share of the reload."""
_LOG_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d{6}) \d+ \S+\] \"(.*)\"$")
_EVENTS = (
    ("loading", re.compile(r"^loading: (?P<model>\S+):\d+$")),
    ("stub started", re.compile(r"^Starting Python backend stub")),
    ("instance ready", re.compile(r"^TRITONBACKEND_ModelInstanceInitialize: instance initial")),
    ("warm-up", re.compile(r"is running warmup sample")),
    ("loaded", re.compile(r"^successfully loaded '(?P<model>[^']+)'")),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reload:
    model: str
    transport: str
    seconds: float
    """From sending the load request to its answer."""
    timeline: tuple[tuple[str, float], ...]
    """Triton's own events, seconds after the load request."""
    during: int
    """Requests sent from the load request until its answer."""
    held: int
    """Of the requests in flight during the reload, those that waited half of it or more."""
    p99_ms: float | None
    max_ms: float | None
    failed: int


def log_events(
    log: Path, *, since: float, until: float, day: datetime.date
) -> list[tuple[str, float]]:
    """Triton's reload events in [since, until] (wall clock), as (event, wall time)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        matched = _LOG_LINE.match(line)
        if matched is None:
            continue
        clock = datetime.datetime.combine(
            day, datetime.time.fromisoformat(matched.group(2))
        ).astimezone()
        moment = clock.timestamp()
        if not since <= moment <= until:
            continue
        for name, pattern in _EVENTS:
            if pattern.search(matched.group(3)):
                found.append((name, moment))
    return found


def summarised(events: Sequence[tuple[str, float]], start: float) -> tuple[tuple[str, float], ...]:
    """The first of each event and the last instance ready, seconds after `start`."""
    kept: dict[str, float] = {}
    for name, moment in events:
        if name == "instance ready":
            kept["last instance ready"] = moment - start
        kept.setdefault(name, moment - start)
    return tuple(sorted(kept.items(), key=lambda item: item[1]))


async def _reload_over(
    transport: str, triton: local_triton.LocalTriton, model: str, config: dict[str, Any]
) -> None:
    if transport == "http":
        # The product's own client and request: what the operator and the runner send.
        async with servers.TritonServer(triton.http_url) as server:
            await server.load(model, config)
        return
    client = tritonclient.grpc.aio.InferenceServerClient(f"127.0.0.1:{triton.ports.grpc}")
    try:
        await client.load_model(model, config=json.dumps(config))
    finally:
        await client.close()


async def measure(
    triton: local_triton.LocalTriton, model: str, transports: Sequence[str], rounds: int
) -> list[Reload]:
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{triton.http_url}/v2/models/{model}/config") as response:
            config = await response.json()
        payload = await loadgen.payload_from_metadata(session, triton.http_url, model)
    plan = [transport for _ in range(rounds) for transport in transports]
    # Long enough for every reload and the settling after it; the load ends by itself.
    seconds = SETTLE_SECONDS + len(plan) * (SETTLE_SECONDS + 15.0)
    origin = loop.time() + 0.5
    records: list[loadgen.RequestRecord] = []
    load = asyncio.create_task(
        loadgen.run_load(
            base_url=triton.http_url,
            payload=payload,
            phases=[loadgen.Phase(rate=RATE, seconds=seconds)],
            seed=11,
            start=origin,
            on_record=records.append,
        )
    )
    found = []
    try:
        await asyncio.sleep(0.5 + SETTLE_SECONDS)
        for index, transport in enumerate(plan):
            delay = 500 + 250 * (index % 2)  # a change each time: a real reload, never a no-op
            changed = json.loads(json.dumps(config))
            changed.setdefault("dynamic_batching", {})["max_queue_delay_microseconds"] = delay
            wall, asked = time.time(), loop.time() - origin
            await _reload_over(transport, triton, model, changed)
            answered = loop.time() - origin
            wall_end = time.time()
            await asyncio.sleep(SETTLE_SECONDS)
            found.append(
                _account(
                    model=model,
                    transport=transport,
                    records=records,
                    asked=asked,
                    answered=answered,
                    timeline=summarised(
                        log_events(
                            triton.log_path,
                            since=wall - 0.01,
                            until=wall_end + 0.01,
                            day=datetime.date.today(),
                        ),
                        wall,
                    ),
                )
            )
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    return found


def _account(
    *,
    model: str,
    transport: str,
    records: Sequence[loadgen.RequestRecord],
    asked: float,
    answered: float,
    timeline: tuple[tuple[str, float], ...],
) -> Reload:
    seconds = answered - asked
    in_flight = [
        r
        for r in records
        if r.sent is not None and r.sent < answered and r.sent + (r.latency or 0.0) >= asked
    ]
    p99, top = benchmarking.percentiles_ms(in_flight, (99, 100))
    latencies = [r.latency for r in in_flight if r.succeeded and r.latency is not None]
    return Reload(
        model=model,
        transport=transport,
        seconds=seconds,
        timeline=timeline,
        during=sum(1 for r in records if r.sent is not None and asked <= r.sent < answered),
        held=sum(1 for value in latencies if value >= HELD_FRACTION * seconds),
        p99_ms=p99,
        max_ms=top,
        failed=sum(1 for r in in_flight if not r.succeeded),
    )


def run_model(
    model: str, transports: Sequence[str], rounds: int, out: Path, *, http_threads: int | None
) -> list[Reload]:
    threads = [f"--http-thread-count={http_threads}"] if http_threads else []
    triton = local_triton.LocalTriton(
        model_repository=demo_models.MODEL_REPOSITORY,
        models=[model],
        run_directory=out / f"reload-{model}",
        exit_timeout_seconds=1,
        extra_arguments=["--log-verbose=1", *threads],
    )
    with triton:
        return asyncio.run(measure(triton, model, transports, rounds))


def tables(found: Sequence[Reload], *, markdown: bool = False) -> str:
    headers = [
        "model",
        "load sent by",
        "reload s",
        "sent during",
        "held >= half",
        "p99 ms",
        "max ms",
        "failed",
        "Triton's timeline (s after the load request)",
    ]
    rows = [
        [
            r.model,
            r.transport,
            f"{r.seconds:.2f}",
            str(r.during),
            str(r.held),
            benchmarking.cell(r.p99_ms, 0),
            benchmarking.cell(r.max_ms, 0),
            str(r.failed),
            ", ".join(f"{name} {at:.2f}" for name, at in r.timeline),
        ]
        for r in found
    ]
    render = benchmarking.markdown_table if markdown else benchmarking.table
    return render(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="one reload each way, torch_mlp")
    parser.add_argument(
        "--http-threads", type=int, help="Triton's --http-thread-count (its default: 8)"
    )
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    out: Path = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    models = (
        [demo_models.TORCH_MLP] if arguments.short else [demo_models.GPU_SIM, demo_models.TORCH_MLP]
    )
    rounds = 1 if arguments.short else 3
    found = [
        reload
        for model in models
        for reload in run_model(
            model, ("http", "grpc"), rounds, out, http_threads=arguments.http_threads
        )
    ]
    threads = arguments.http_threads or "Triton's default 8"
    print(
        f"Reloads under {RATE:g} req/s of HTTP load on keep-alive connections, one Triton "
        f"({threads} HTTP worker threads); held: waited half the reload or more."
    )
    benchmarking.write_summary(
        out,
        "summary-reload",
        tables=lambda markdown: tables(found, markdown=markdown),
        data=[dataclasses.asdict(r) for r in found],
    )
    if arguments.publish:
        benchmarking.publish(out, ["summary-reload.md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
