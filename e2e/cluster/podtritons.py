"""`python -m e2e.cluster.podtritons`: a Pod's Triton with server flags from a fixed list.

`batchpilot_harness.local_triton` runs the wheel's tritonserver with the flags every test needs;
a Pod may ask for a few more (the pod runner turns its annotations into these options, validated,
never into a command), which this passes through `LocalTriton(extra_arguments=...)`:

- `--grpc-max-connection-age-ms N`: tritonserver's `--grpc-max-connection-age` (and a grace of
  the same length): every gRPC connection is ended with a GOAWAY after about N ms, its calls in
  flight finishing first, so gRPC clients reconnect and a Service routes them afresh.

It otherwise behaves as `python -m batchpilot_harness.local_triton`: in the foreground until
SIGTERM, then the server and its Python-backend stubs stopped.
"""

import argparse
import signal
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from batchpilot_harness import local_triton
from batchpilot_triton import endpoints


class _Stop(Exception):
    pass


def _stop(signum: int, frame: types.FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def extra_arguments(*, grpc_max_connection_age_ms: int | None) -> list[str]:
    if grpc_max_connection_age_ms is None:
        return []
    return [
        f"--grpc-max-connection-age={grpc_max_connection_age_ms}",
        f"--grpc-max-connection-age-grace={grpc_max_connection_age_ms}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster.podtritons", description=__doc__)
    parser.add_argument("--host", default=endpoints.EVERY_ADDRESS)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--model", action="append", default=[], dest="models")
    parser.add_argument("--grpc-max-connection-age-ms", type=int)
    arguments = parser.parse_args(argv)
    server = local_triton.LocalTriton(
        model_repository=arguments.model_repository,
        models=arguments.models,
        host=arguments.host,
        http_port=arguments.http_port,
        grpc_port=arguments.grpc_port,
        metrics_port=arguments.metrics_port,
        log_to_console=True,
        extra_arguments=extra_arguments(
            grpc_max_connection_age_ms=arguments.grpc_max_connection_age_ms
        ),
    )
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with local_triton.adopting_orphans():
        try:
            server.start()
            print(f"podtritons: ready in {server.wait_ready(120):.2f} s", flush=True)
            return server.wait() or 1
        except _Stop:
            return 0
        except local_triton.LocalTritonError as error:
            print(f"podtritons: {error}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
