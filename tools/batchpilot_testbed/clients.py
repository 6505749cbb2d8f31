"""Triton clients as applications write them, run where a client Pod would: in a network namespace.

A Service routes *connections*: kube-proxy picks a Ready endpoint when a connection opens, and
conntrack keeps every later packet of it on that endpoint, whatever the endpoints become. So what
a drain achieves depends on how the client holds its connections, and these are the behaviours
compared (`STYLES`):

- `new-connection`: a connection per request (`Connection: close`), each routed afresh;
- `keep-alive`: `tritonclient.http.aio`, which pools keep-alive HTTP connections (aiohttp's);
- `one-connection`: the same with a pool of one (`conn_limit=1`), as a client or proxy that
  holds one upstream connection: every request follows the Pod it reached first. A larger pool
  opens connections when requests pile up (a busy machine) and may leave its older ones idle, so
  whether a drained Pod keeps receiving requests is the pool's choice; with one it always does;
- `grpc`: `tritonclient.grpc.aio`, one gRPC channel (HTTP/2) for every request;
- `endpoint-aware` (not here: `balanced`, in the test process): each request to a Ready Pod
  chosen when it is due, from the Pods' readiness, as a service mesh or a gRPC xDS client does.

Each sends open-loop Poisson arrivals drawn from a seed until it is told to stop, and records
every request as a `loadgen.RequestRecord`, its times measured from an `origin` given as a
`time.monotonic()` reading (one clock for every process on the machine).

`ClientProcess` runs one inside a client host (`podnetwork.client_host`): `python -m
batchpilot_testbed.clients
load ...` under `ip netns exec`, stopped by closing its stdin, its records read back from a file.
`probe` asks a URL a few times, a new connection each, and says who answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, Protocol, Self

import aiohttp
import numpy as np

from batchpilot_cluster import locations, podnetwork
from batchpilot_harness import loadgen
from batchpilot_triton import endpoints

STYLES: Final = ("new-connection", "keep-alive", "one-connection", "grpc")
BALANCED: Final = "endpoint-aware"
MODEL: Final = "gpu_sim"
INPUT_SHAPE: Final = (1, 16)
REQUEST_TIMEOUT: Final = 30.0
MAX_IN_FLIGHT: Final = 512
MAX_SECONDS: Final = 900.0
"""A client process stops by itself after this long, should its parent never stop it."""


class Sender(Protocol):
    """Sends one inference request; the error, or None when it succeeded."""

    async def send(self) -> tuple[str | None, str | None]:
        """(error, where it went, when known)."""
        ...

    async def close(self) -> None: ...


def _payload() -> loadgen.InferencePayload:
    return loadgen.InferencePayload.for_input(
        model=MODEL, input_name="INPUT", datatype="FP32", shape=list(INPUT_SHAPE)
    )


class _Posting:
    """KServe v2 JSON over aiohttp, to one URL or to one an endpoint chooser picks."""

    def __init__(self, choose: Callable[[], str | None], *, new_connection: bool) -> None:
        self.choose = choose
        self.body = _payload().body
        connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT, force_close=new_connection)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        )

    async def send(self) -> tuple[str | None, str | None]:
        base_url = self.choose()
        if base_url is None:
            return "no endpoint to send it to", None
        try:
            async with self.session.post(
                f"{base_url}/v2/models/{MODEL}/infer",
                data=self.body,
                headers={"Content-Type": "application/json"},
            ) as response:
                body = await response.read()
                if response.status != 200:
                    text = body[:200].decode(errors="replace")
                    return f"HTTP {response.status}: {text}", base_url
        except (aiohttp.ClientError, TimeoutError) as failure:
            return f"{type(failure).__name__}: {failure}", base_url
        return None, base_url

    async def close(self) -> None:
        await self.session.close()


def _inputs(module: types.ModuleType) -> list[object]:
    data = np.random.default_rng(0).uniform(-1, 1, size=INPUT_SHAPE).astype(np.float32)
    item = module.InferInput("INPUT", list(INPUT_SHAPE), "FP32")
    item.set_data_from_numpy(data)
    return [item]


class _TritonClient:
    """tritonclient's asyncio client, HTTP (a keep-alive pool) or gRPC (one channel)."""

    def __init__(self, address: str, *, grpc: bool, connections: int | None = None) -> None:
        self.grpc = grpc
        self.address = address
        if grpc:
            import tritonclient.grpc.aio as module

            self.client = module.InferenceServerClient(address)  # its defaults, as apps do
        else:
            import tritonclient.http.aio as module

            limit = {"conn_limit": connections} if connections else {}
            self.client = module.InferenceServerClient(address, **limit)
        self.inputs = _inputs(module)

    async def send(self) -> tuple[str | None, str | None]:
        timeout = {"client_timeout": REQUEST_TIMEOUT} if self.grpc else {}
        try:
            await self.client.infer(MODEL, self.inputs, **timeout)
        except Exception as failure:  # every failure is a failed request
            return f"{type(failure).__name__}: {failure}"[:300], self.address
        return None, self.address

    async def close(self) -> None:
        await self.client.close()


def sender(style: str, address: str) -> Sender:
    """A client of `style` for the Triton (or Service) at `address` (host:port)."""
    if style == "new-connection":
        return _Posting(lambda: f"http://{address}", new_connection=True)
    if style == "keep-alive":
        return _TritonClient(address, grpc=False)
    if style == "one-connection":
        return _TritonClient(address, grpc=False, connections=1)
    if style == "grpc":
        return _TritonClient(address, grpc=True)
    raise ValueError(f"unknown client style {style!r}; one of {STYLES}")


def balanced(choose: Callable[[], str | None]) -> Sender:
    """The endpoint-aware client: keep-alive connections to Pods, each request to the base URL
    `choose` returns when it is due (a Ready Pod)."""
    return _Posting(choose, new_connection=False)


def poisson_offsets(rate: float, *, seed: int, until: float) -> Iterator[float]:
    """Arrival offsets of a Poisson process at `rate`, drawn from `seed` as they are needed
    (`loadgen.poisson_arrivals` draws a whole schedule at once, which takes a while for a long
    one)."""
    generator = np.random.default_rng(seed)
    last = 0.0
    while True:
        for offset in last + np.cumsum(generator.exponential(1.0 / rate, size=1024)):
            if offset >= until:
                return
            yield float(offset)
        last = float(offset)


async def open_loop(
    client: Sender,
    *,
    rate: float,
    seed: int,
    origin: float,
    stop: asyncio.Event,
    max_seconds: float = MAX_SECONDS,
) -> list[loadgen.RequestRecord]:
    """Poisson arrivals at `rate` from `origin` (a loop time) until `stop` is set, each sent when
    it is due whatever the earlier ones do; waits for those in flight."""
    loop = asyncio.get_running_loop()
    records: list[loadgen.RequestRecord] = []
    in_flight: set[asyncio.Task[None]] = set()

    async def one(scheduled: float) -> None:
        sent = loop.time() - origin
        error, server = await client.send()
        records.append(
            loadgen.RequestRecord(
                phase=0,
                scheduled=scheduled,
                sent=sent,
                latency=loop.time() - origin - sent,
                status=200 if error is None else None,
                error=error,
                server=server,
            )
        )

    for offset in poisson_offsets(rate, seed=seed, until=max_seconds):
        delay = origin + offset - loop.time()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            break
        if len(in_flight) >= MAX_IN_FLIGHT:
            records.append(
                loadgen.RequestRecord(
                    phase=0,
                    scheduled=offset,
                    sent=None,
                    latency=None,
                    status=None,
                    error=f"{MAX_IN_FLIGHT} requests in flight already",
                )
            )
            continue
        task = asyncio.create_task(one(offset))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
    return sorted(records, key=lambda record: record.scheduled)


# -- in a client host ---------------------------------------------------------------------------


def _environment() -> dict[str, str]:
    """The checkout's code first: a client host runs this checkout, not an installed copy."""
    env = dict(os.environ)
    roots = [locations.REPO_ROOT / folder for folder in ("operator", "sidecar", "tools")]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, roots), *filter(None, [env.get("PYTHONPATH")])])
    return env


class ClientProcess:
    """One client of `style` in `host`, sending `rate` requests per second to `address`; a
    context manager that starts the process and waits until its client exists. `start()` sets
    it going, `stop()` ends it and returns its records."""

    def __init__(
        self, host: podnetwork.Host, *, style: str, address: str, rate: float, seed: int = 0
    ) -> None:
        if style not in STYLES:
            raise ValueError(f"unknown client style {style!r}; one of {STYLES}")
        self.style = style
        self.origin = 0.0
        """When its load began: a time.monotonic() reading; record times count from it."""
        self._folder = tempfile.TemporaryDirectory(prefix="batchpilot-client-")
        self.records_path = Path(self._folder.name) / "records.jsonl"
        self.argv = host.exec_argv(
            [
                sys.executable, "-m", "batchpilot_testbed.clients", "load",
                "--style", style, "--address", address, "--rate", f"{rate:g}",
                "--seed", str(seed), "--records", str(self.records_path),
                "--parent", str(os.getpid()),
            ]
        )  # fmt: skip
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_environment(),
            cwd=locations.REPO_ROOT,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # "ready", once its client exists
        if line.strip() != "ready":
            self._end(kill=True)
            raise RuntimeError(f"the {self.style} client did not start: {line}{self._stderr()}")
        return self

    def start(self, origin: float | None = None) -> float:
        """Send from `origin` (a time.monotonic() reading; default: now) on; returns it."""
        assert self.process is not None
        assert self.process.stdin is not None
        self.origin = time.monotonic() if origin is None else origin
        self.process.stdin.write(f"{self.origin!r}\n")
        self.process.stdin.flush()
        return self.origin

    def stop(self, *, timeout: float = 60.0) -> list[loadgen.RequestRecord]:
        """Stop sending, wait for the requests in flight, return every record."""
        assert self.process is not None
        self._end(kill=False, timeout=timeout)
        if self.process.returncode != 0:
            raise RuntimeError(
                f"the {self.style} client exited with {self.process.returncode}: {self._stderr()}"
            )
        lines = self.records_path.read_text().splitlines()
        return [loadgen.RequestRecord(**json.loads(line)) for line in lines]

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self._end(kill=True)
            for pipe in (self.process.stdout, self.process.stderr):
                if pipe is not None:
                    pipe.close()
        self._folder.cleanup()

    def _end(self, *, kill: bool, timeout: float = 10.0) -> None:
        process = self.process
        assert process is not None
        if process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                process.stdin.close()
        if kill:
            process.kill()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def _stderr(self) -> str:
        assert self.process is not None
        if self.process.poll() is None or self.process.stderr is None:
            return ""
        return self.process.stderr.read()[-2000:]


def probe(host: podnetwork.Host, url: str, *, count: int) -> Counter[str]:
    """GET `url` `count` times from `host`, a new connection each: how often each body (or
    error) came back."""
    argv = host.exec_argv(
        [
            sys.executable,
            "-m",
            "batchpilot_testbed.clients",
            "probe",
            "--url",
            url,
            "--count",
            str(count),
        ]
    )
    done = subprocess.run(
        argv, capture_output=True, text=True, env=_environment(), cwd=locations.REPO_ROOT,
        timeout=30 + 3 * count, check=True,
    )  # fmt: skip
    return Counter(json.loads(done.stdout))


# -- the process inside --------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the process that started this one dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        raise SystemExit(1)


async def _load(arguments: argparse.Namespace) -> list[loadgen.RequestRecord]:
    """Ready; then the origin on stdin; then load until stdin closes (or SIGTERM)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    origin: asyncio.Future[float | None] = loop.create_future()

    def begin(at: float | None) -> None:
        if not origin.done():
            origin.set_result(at)

    def halt() -> None:
        begin(None)
        stop.set()

    def read_stdin() -> None:
        line = sys.stdin.readline()
        if line.strip():
            loop.call_soon_threadsafe(begin, float(line))
        sys.stdin.read()
        loop.call_soon_threadsafe(halt)

    loop.add_signal_handler(signal.SIGTERM, halt)
    client = sender(arguments.style, arguments.address)
    threading.Thread(target=read_stdin, daemon=True).start()
    print("ready", flush=True)
    try:
        at = await origin
        if at is None:
            return []
        return await open_loop(
            client,
            rate=arguments.rate,
            seed=arguments.seed,
            origin=at,
            stop=stop,
            max_seconds=arguments.max_seconds,
        )
    finally:
        await client.close()


def _probe(url: str, count: int) -> dict[str, int]:
    answers: Counter[str] = Counter()
    for _ in range(count):
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                answers[response.read().decode().strip()] += 1
        except (urllib.error.URLError, OSError) as error:
            answers[f"error: {type(error).__name__}"] += 1
    return dict(answers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_testbed.clients", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("load", help="send open-loop load until stdin closes")
    load.add_argument("--style", choices=STYLES, required=True)
    load.add_argument("--address", required=True, help="HOST:PORT of Triton or its Service")
    load.add_argument("--rate", type=float, required=True)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--records", type=Path, required=True, help="where to write them")
    load.add_argument("--parent", type=int, help="stop when this process dies")
    load.add_argument("--max-seconds", type=float, default=MAX_SECONDS)
    asking = commands.add_parser("probe", help="GET a URL a few times; JSON counts of answers")
    asking.add_argument("--url", required=True)
    asking.add_argument("--count", type=int, default=10)
    arguments = parser.parse_args(argv)
    if arguments.command == "probe":
        print(json.dumps(_probe(arguments.url, arguments.count)))
        return 0
    if arguments.parent is not None:
        _die_with_parent(arguments.parent)
    records = asyncio.run(_load(arguments))
    with arguments.records.open("w") as out:
        for record in records:
            out.write(json.dumps(dataclasses.asdict(record)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


@dataclasses.dataclass
class PodLoads:
    """What `load_on_each` sent: from `origin` (a time.monotonic() reading) on, and, once it has
    stopped, the records of each Pod's client under the Pod's name."""

    origin: float
    records: dict[str, list[loadgen.RequestRecord]] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def load_on_each(host: podnetwork.Host, ips: dict[str, str], *, rate: float) -> Iterator[PodLoads]:
    """A keep-alive client per Pod, straight to its IP (so that each failure is the Pod's),
    `rate` requests per second each, from `host`."""
    with contextlib.ExitStack() as stack:
        loads = {
            pod: stack.enter_context(
                ClientProcess(
                    host,
                    style="keep-alive",
                    address=f"{ip}:{endpoints.TRITON_HTTP_PORT}",
                    rate=rate,
                    seed=seed,
                )
            )
            for seed, (pod, ip) in enumerate(sorted(ips.items()))
        }
        sent = PodLoads(origin=time.monotonic())
        for load in loads.values():
            load.start(sent.origin)
        yield sent
        for pod, load in loads.items():
            sent.records[pod] = load.stop()


class PodArrivals:
    """Poisson arrivals straight to each Pod's IP, from this process, in a thread of their own:
    `rate` requests per second each, for at most `seconds` (or until `stop()`), every request
    recorded with the Pod's URL and its time on `now()`'s clock."""

    def __init__(self, ips: dict[str, str], *, rate: float, seconds: float) -> None:
        self._records: list[loadgen.RequestRecord] = []
        self._lock = threading.Lock()
        self._stopped = False
        self.started = time.monotonic()
        payload = _payload()

        def keep(record: loadgen.RequestRecord) -> None:
            with self._lock:
                if not self._stopped:
                    self._records.append(record)

        async def run() -> None:
            await asyncio.gather(
                *(
                    loadgen.run_load(
                        base_url=f"http://{ip}:{endpoints.TRITON_HTTP_PORT}",
                        payload=payload,
                        phases=[loadgen.Phase(rate=rate, seconds=seconds)],
                        seed=index,
                        on_record=keep,
                        start=self.started,
                    )
                    for index, ip in enumerate(ips.values())
                )
            )

        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(run())

        def drive() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._task)
            self._loop.close()

        self._thread = threading.Thread(target=drive, name="pod-arrivals", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds since the arrivals began: the clock of the records' `scheduled` times."""
        return time.monotonic() - self.started

    def records(self) -> list[loadgen.RequestRecord]:
        with self._lock:
            return list(self._records)

    def stop(self, timeout: float = 30.0) -> list[loadgen.RequestRecord]:
        """End the arrivals; every request that completed before. Those in flight are cut
        (their client closes under them) and not recorded: their failures are the stop's."""
        with self._lock:
            self._stopped = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the arrivals did not stop within {timeout:g}s")
        return self.records()
