"""Run batchpilot's sidecar as a child process beside a `LocalTriton`, as it runs in a Triton Pod.

It listens on a free loopback port and is handed out once its /healthz answers; at the end it gets
SIGTERM, and SIGKILL if it has not stopped within the grace period, as from a kubelet. Its exit
status stays on the process for callers that judge how it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from batchpilot_harness import local_triton

MODULE = ("-m", "batchpilot_sidecar")
"""The command after the interpreter: the sidecar's own entry point (`-m batchpilot sidecar` is
the other)."""


class LocalSidecarError(RuntimeError):
    """The sidecar exited, or did not answer, before it became healthy."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSidecar:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def running(
    triton: local_triton.LocalTriton,
    *arguments: str,
    command: Sequence[str] = MODULE,
    log: Path | None = None,
    ready_timeout: float = 30.0,
    grace_seconds: float = 20.0,
) -> Iterator[LocalSidecar]:
    """The sidecar for `triton`, with `arguments` after its URLs and address; its output goes
    to the end of `log`, or nowhere."""
    (port,) = local_triton.free_ports("127.0.0.1", 1)
    argv = [
        sys.executable, *command,
        "--triton-url", triton.http_url,
        "--metrics-url", triton.metrics_url,
        "--listen", f"127.0.0.1:{port}",
        *arguments,
    ]  # fmt: skip
    with contextlib.ExitStack() as output:
        sink = output.enter_context(log.open("ab")) if log else subprocess.DEVNULL
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)  # noqa: S603
    sidecar = LocalSidecar(url=f"http://127.0.0.1:{port}", process=process)
    try:
        _wait_healthy(sidecar, timeout=ready_timeout, log=log)
        yield sidecar
    finally:
        process.terminate()
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(sidecar: LocalSidecar, *, timeout: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if sidecar.process.poll() is not None:
            raise LocalSidecarError(
                f"the sidecar exited with {sidecar.process.returncode}{_tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"{sidecar.url}/healthz", timeout=2):  # noqa: S310
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise LocalSidecarError(
                    f"the sidecar did not come up in {timeout:g} s{_tail(log)}"
                ) from None
            time.sleep(0.1)


def _tail(log: Path | None) -> str:
    return f"; {log} ends with:\n{log.read_text(errors='replace')[-2000:]}" if log else ""
