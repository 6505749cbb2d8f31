"""Run the `tritonserver` bundled in the `nvidia-pytriton` wheel as a local child process.

The wheel carries a full Triton Inference Server (CPU capable) and its Python backend, which is all
the tests, the demo and the benchmarks need, on machines without Docker or a GPU. Using it takes
three things the wheel does not do by itself:

- The Python backend refuses to load a model until `triton_python_backend_stub` for the running
  Python sits next to `libtriton_python.so`. We assemble a backend directory of our own in a cache
  (never in site-packages) and copy the stub for this interpreter into it.
- The binaries find their shared libraries through RUNPATHs relative to the wheel layout, which the
  copied backend no longer has, so `nvidia_pytriton.libs/` goes on `LD_LIBRARY_PATH`.
- The stub embeds CPython: it loads whatever `libpython3.X.so` the loader finds, and that
  interpreter derives its prefix by looking for `python3` on `PATH`. Putting this interpreter's
  `bin/` first on `PATH` makes the stub adopt our virtualenv (its `pyvenv.cfg`, its site-packages,
  hence numpy and torch), and putting this interpreter's `LIBDIR` on `LD_LIBRARY_PATH` makes it load
  the matching `libpython` instead of the system one.

The server runs in its own process group, so stopping it can account for the stub processes too:
SIGTERM first (Triton drains for `--exit-timeout-secs`), then SIGKILL for whatever is left of the
group, and no return until nothing of it is left. A server that runs out of its exit timeout exits
without stopping its stubs (unloading a four-instance model takes it about four seconds); the
orphans would be re-parented to init and linger as processes, then zombies, so while it stops a
server its owner is a child subreaper, and kills and reaps them itself. Stubs that die that way
leave their shared-memory regions in /dev/shm; the server's unique region prefix finds them.

Start-up to readiness, measured on 2 cores with warm caches: 0.3 s with gpu_sim, 1.4 s with
torch_mlp (each stub imports torch), 1.6 s with both; a cold first import of torch adds seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self

from batchpilot_harness import procfs

# The demo models' emulated device is one lock file per server; see manifests/model-repository.
DEVICE_LOCK_ENV = "BATCHPILOT_DEVICE_LOCK"
# The command line's repository credential comes from the environment, as a Pod's would.
REPOSITORY_TOKEN_ENV = "TRITON_REPOSITORY_TOKEN"  # noqa: S105 - a variable name
CACHE_ENV = "BATCHPILOT_CACHE"

_STUB_NAME = "triton_python_backend_stub"
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_LOG_TAIL_BYTES = 4000


class LocalTritonError(RuntimeError):
    """The local Triton server could not be prepared, started or made ready."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonDistribution:
    """Where the parts of the `nvidia-pytriton` wheel live in this environment."""

    version: str
    server_binary: Path
    shared_libraries: Path
    python_backend: Path
    python_backend_stubs: Path

    def stub_for(self, python_version: str) -> Path:
        return self.python_backend_stubs / python_version / _STUB_NAME


def find_distribution() -> TritonDistribution:
    """Locate the wheel's files without importing `pytriton` (its import is slow and unneeded)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LocalTritonError(
            "nvidia-pytriton is not installed; install batchpilot with the 'triton' extra"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    server_dir = package_dir / "tritonserver"
    distribution = TritonDistribution(
        version=importlib.metadata.version("nvidia-pytriton"),
        server_binary=server_dir / "bin" / "tritonserver",
        shared_libraries=package_dir.parent / "nvidia_pytriton.libs",
        python_backend=server_dir / "backends" / "python",
        python_backend_stubs=server_dir / "python_backend_stubs",
    )
    for required in (
        distribution.server_binary,
        distribution.shared_libraries,
        distribution.python_backend,
    ):
        if not required.exists():
            raise LocalTritonError(f"nvidia-pytriton {distribution.version} lacks {required}")
    return distribution


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "batchpilot"


def prepare_backend_directory(
    distribution: TritonDistribution, *, cache: Path | None = None
) -> Path:
    """Return a `--backend-directory` whose Python backend has the stub for this interpreter.

    Built once per (pytriton version, Python version) and published with an atomic rename, so
    concurrent test processes either reuse a complete directory or build their own copy.
    """
    python_version = _python_version()
    stub = distribution.stub_for(python_version)
    if not stub.is_file():
        raise LocalTritonError(
            f"nvidia-pytriton {distribution.version} has no Python backend stub for "
            f"Python {python_version} (looked for {stub})"
        )
    backends_root = (cache or cache_root()) / "triton-backends" / distribution.version
    backend_directory = backends_root / f"python{python_version}"
    expected = [*_BACKEND_FILES, _STUB_NAME]
    if all((backend_directory / "python" / name).is_file() for name in expected):
        return backend_directory

    backends_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=backends_root))
    try:
        python_dir = staging / "python"
        python_dir.mkdir()
        for name in _BACKEND_FILES:
            shutil.copy2(distribution.python_backend / name, python_dir / name)
        shutil.copy2(stub, python_dir / _STUB_NAME)
        try:
            staging.rename(backend_directory)
        except OSError:
            # Another process published it first; theirs is as good as ours.
            if not backend_directory.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return backend_directory


def with_python_backends(backend_directory: Path, backends: Mapping[str, Path], into: Path) -> Path:
    """A `--backend-directory` with Python-based backends (a directory holding `model.py`, for
    `backend: "<name>"` in a model config) beside the Python backend of `backend_directory`."""
    into.mkdir(parents=True, exist_ok=True)
    python = into / "python"
    if not python.is_symlink():
        python.symlink_to(backend_directory / "python", target_is_directory=True)
    for name, source in backends.items():
        if not (source / "model.py").is_file():
            raise LocalTritonError(f"Python-based backend {name!r}: no model.py in {source}")
        shutil.rmtree(into / name, ignore_errors=True)
        shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def server_environment(
    distribution: TritonDistribution,
    *,
    base: Mapping[str, str],
    device_lock: Path,
    interpreter: Path | None = None,
) -> dict[str, str]:
    """The environment under which the server and its Python stubs use `interpreter` (default:
    this one) and its virtualenv."""
    environment = dict(base)
    library_dirs = [str(distribution.shared_libraries)]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        library_dirs.append(str(sysconfig.get_config_var("LIBDIR")))
    if environment.get("LD_LIBRARY_PATH"):
        library_dirs.append(environment["LD_LIBRARY_PATH"])
    environment["LD_LIBRARY_PATH"] = os.pathsep.join(library_dirs)
    # sys.executable, not its resolved target: a virtualenv is recognised by the pyvenv.cfg
    # next to (or above) the `python3` found on PATH.
    interpreter_bin = str((interpreter or Path(sys.executable)).parent)
    environment["PATH"] = os.pathsep.join(
        part for part in (interpreter_bin, environment.get("PATH", "")) if part
    )
    environment[DEVICE_LOCK_ENV] = str(device_lock)
    return environment


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ports:
    http: int
    grpc: int
    metrics: int


def _ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name


def free_ports(host: str, count: int) -> list[int]:
    """Ports the kernel considers free on `host` now (held together, so they are distinct)."""
    address = _ip_address(host)
    family = socket.AF_INET6 if address and address.version == 6 else socket.AF_INET
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(family, socket.SOCK_STREAM)) for _ in range(count)
        ]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _url_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to `host`."""
    address = _ip_address(host)
    if address is None:
        return host
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"[{address}]" if address.version == 6 else str(address)


def _exit_status(pid: int) -> int | None:
    """A child's exit status (negative: killed by that signal), without reaping it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -1  # reaped by someone else; the status is gone
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _set_child_subreaper(value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """Make this process the reaper of its orphaned descendants for a while.

    Only for as long as it takes to stop a server: every descendant orphaned meanwhile becomes
    our child, and a caller such as a test runner should not keep adopting strangers' orphans.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    previous = ctypes.c_int(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_GET_CHILD_SUBREAPER) failed")
    _set_child_subreaper(1)
    try:
        yield
    finally:
        _set_child_subreaper(previous.value)


class LocalTriton:
    """One `tritonserver` child process with its own ports, backend directory and run directory.

    Use as a context manager, or call `start()`, `wait_ready()` and `stop()`. With
    `explicit_model_control=False` the server runs in Triton's default "none" mode, which loads
    every model of its repository at start-up and refuses load and unload requests; the chosen
    models are then presented through a repository of symlinks in the run directory.

    The run directory holds the server log and the emulated-device lock. Without one given, a
    temporary directory is made and removed by `stop()`; give one to keep the log.
    """

    def __init__(
        self,
        *,
        model_repository: Path,
        models: Sequence[str] = (),
        host: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int = 0,
        metrics_port: int = 0,
        explicit_model_control: bool = True,
        exit_timeout_seconds: int = 2,
        run_directory: Path | None = None,
        log_to_console: bool = False,
        extra_arguments: Sequence[str] = (),
        repository_credential: tuple[str, str] | None = None,
        environment: Mapping[str, str] | None = None,
        distribution: TritonDistribution | None = None,
        interpreter: Path | None = None,
        python_backends: Mapping[str, Path] | None = None,
        ready_timeout: float = 60.0,
    ) -> None:
        self.model_repository = model_repository.resolve()
        self.models = tuple(models)
        self.host = host
        self.explicit_model_control = explicit_model_control
        self.exit_timeout_seconds = exit_timeout_seconds
        self.extra_arguments = tuple(extra_arguments)
        self.repository_credential = repository_credential
        """(header, value): the model-repository API (HTTP and gRPC) refuses calls without it,
        as the manifests' Triton does; inference stays open."""
        self.environment = dict(environment or {})
        """Variables set for the server on top of ours (CUDA_VISIBLE_DEVICES, for one)."""
        self.interpreter = interpreter
        """The Python (of a virtualenv) the Python stubs run with; default: this one. It must be
        the same Python version as this one: the stub is chosen for it."""
        self.python_backends = dict(python_backends or {})
        """Python-based backends the server offers, by name: directories holding `model.py`."""
        self.ready_timeout = ready_timeout
        """How long `wait_ready()`, and so a with-block, waits for the server by default."""
        self._requested_ports = (http_port, grpc_port, metrics_port)
        self._requested_run_directory = run_directory
        self._log_to_console = log_to_console
        self._distribution = distribution
        self._run_directory: Path | None = None
        self._owns_run_directory = False
        self._ports: Ports | None = None
        if all(self._requested_ports):
            self._ports = Ports(http=http_port, grpc=grpc_port, metrics=metrics_port)
        self._process: subprocess.Popen[bytes] | None = None
        self._started_at: float | None = None
        self._startup_seconds: float | None = None
        self._restore_sigterm: Callable[[], None] = lambda: None
        # Python-backend shared-memory regions are named; two servers must not share names.
        self._shared_memory_prefix = f"batchpilot_{uuid.uuid4().hex[:12]}_"

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._process is not None:
            raise LocalTritonError("this LocalTriton was already started")
        for name in self.models:
            if not (self.model_repository / name / "config.pbtxt").is_file():
                raise LocalTritonError(f"no model {name!r} in {self.model_repository}")
        distribution = self._distribution or find_distribution()
        backend_directory = prepare_backend_directory(distribution)

        if self._requested_run_directory is None:
            self._run_directory = Path(tempfile.mkdtemp(prefix="batchpilot-triton-"))
            self._owns_run_directory = True
        else:
            # Absolute: the server runs in it, and the device lock is named from it.
            self._run_directory = self._requested_run_directory.resolve()
            self._run_directory.mkdir(parents=True, exist_ok=True)
        if self._ports is None:
            wanted = self._requested_ports
            automatic = iter(free_ports(self.host, sum(1 for port in wanted if port == 0)))
            http, grpc, metrics = (port or next(automatic) for port in wanted)
            self._ports = Ports(http=http, grpc=grpc, metrics=metrics)

        if self.python_backends:
            backend_directory = with_python_backends(
                backend_directory, self.python_backends, into=self._run_directory / "backends"
            )
        command = self.command(distribution=distribution, backend_directory=backend_directory)
        environment = server_environment(
            distribution,
            base={**os.environ, **self.environment},
            device_lock=self._run_directory / "device.lock",
            interpreter=self.interpreter,
        )
        self._started_at = time.monotonic()
        if self._log_to_console:
            self._process = subprocess.Popen(  # noqa: S603 -- our own argument vector
                command,
                env=environment,
                cwd=self._run_directory,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        else:
            with self.log_path.open("ab") as log:
                self._process = subprocess.Popen(  # noqa: S603 -- our own argument vector
                    command,
                    env=environment,
                    cwd=self._run_directory,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def command(self, *, distribution: TritonDistribution, backend_directory: Path) -> list[str]:
        ports = self.ports
        command = [
            str(distribution.server_binary),
            f"--backend-directory={backend_directory}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            f"--http-port={ports.http}",
            f"--grpc-port={ports.grpc}",
            f"--metrics-port={ports.metrics}",
            "--metrics-config=summary_latencies=true",
            f"--exit-timeout-secs={self.exit_timeout_seconds}",
            # Python-backend shared-memory regions are named; two servers must not share names.
            f"--backend-config=python,shm-region-prefix-name={self._shared_memory_prefix}",
            # Our configs are complete; auto-completion would start (and import) every model once
            # more before its instances, which doubles the start-up time of torch_mlp.
            "--disable-auto-complete-config",
        ]
        if self.explicit_model_control:
            command += [
                f"--model-repository={self.model_repository}",
                "--model-control-mode=explicit",
                *(f"--load-model={name}" for name in self.models),
            ]
        else:
            command += [
                f"--model-repository={self._repository_view()}",
                "--model-control-mode=none",
            ]
        return [
            *command,
            *restricted_repository_arguments(self.repository_credential),
            *self.extra_arguments,
        ]

    def _repository_view(self) -> Path:
        """What a non-explicit server loads entirely: the chosen models, or the whole repository."""
        if not self.models:
            return self.model_repository
        view = self.run_directory / "model-repository"
        view.mkdir(exist_ok=True)
        for name in self.models:
            link = view / name
            if not link.is_symlink():
                link.symlink_to(self.model_repository / name, target_is_directory=True)
        return view

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(  # noqa: S310 -- an http URL we built
                f"{self.http_url}/v2/health/ready", timeout=1.0
            ) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self, timeout: float | None = None) -> float:
        """Wait until the server and its start-up models are ready (at most `timeout` seconds,
        `ready_timeout` by default); return the start-up time."""
        process = self._require_process()
        assert self._started_at is not None
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            status = _exit_status(process.pid)
            if status is not None:
                raise LocalTritonError(
                    f"tritonserver exited with status {status} before becoming "
                    f"ready{self._log_excerpt()}"
                )
            if self.is_ready():
                self._startup_seconds = time.monotonic() - self._started_at
                return self._startup_seconds
            if time.monotonic() > deadline:
                raise LocalTritonError(
                    f"tritonserver was not ready within {timeout:.0f} s{self._log_excerpt()}"
                )
            time.sleep(0.05)

    def wait(self) -> int:
        """Block until the server exits on its own; return its exit status.

        The server stays unreaped, so that `stop()` can still address its process group.
        """
        info = os.waitid(os.P_PID, self._require_process().pid, os.WEXITED | os.WNOWAIT)
        assert info is not None  # only None with WNOHANG
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def stop(self, *, grace_seconds: float = 5.0) -> int | None:
        """Stop the server and every process of its group; return the server's exit status.

        The server gets SIGTERM and `exit_timeout_seconds + grace_seconds` to finish. Then the
        whole group gets SIGKILL: a server past its bound, and the stubs that a server which ran
        out of its exit timeout leaves behind (they would otherwise linger until they notice).
        """
        process = self._process
        if process is None:
            return None
        with adopting_orphans():
            status = self._stop(process, grace_seconds=grace_seconds)
        # POSIX shared memory lives here on Linux; the names are ours (a random prefix).
        for region in Path("/dev/shm").glob(f"{self._shared_memory_prefix}*"):  # noqa: S108
            # Stubs that did not shut down gracefully leave their regions behind.
            region.unlink(missing_ok=True)
        if self._owns_run_directory:
            shutil.rmtree(self.run_directory, ignore_errors=True)
        return status

    def _stop(self, process: subprocess.Popen[bytes], *, grace_seconds: float) -> int:
        pgid = process.pid  # start_new_session made the server its group's leader
        if _exit_status(process.pid) is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.exit_timeout_seconds + grace_seconds
            while _exit_status(process.pid) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        # Not reaped yet, the leader still holds the group id, so this cannot hit a stranger.
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        status = process.wait()
        self._reap_group(pgid, timeout=grace_seconds)
        return status

    @staticmethod
    def _reap_group(pgid: int, *, timeout: float) -> None:
        """Kill and reap what is left of the group: orphaned stubs are re-parented to us."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = [
                entry for entry in procfs.group(pgid) if entry.alive or entry.parent == os.getpid()
            ]
            if not remaining:
                return
            if time.monotonic() > deadline:
                raise LocalTritonError(
                    f"processes {[entry.pid for entry in remaining]} of tritonserver's group "
                    f"{pgid} outlived SIGKILL for {timeout:.0f} s"
                )
            for entry in remaining:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(entry.pid, signal.SIGKILL)
                if entry.parent == os.getpid():
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(entry.pid, os.WNOHANG)
            time.sleep(0.02)

    def __enter__(self) -> Self:
        # Whatever runs the server in a with-block (a benchmark, the demo) stops it on SIGTERM
        # too, instead of leaving it and its engine running.
        self._restore_sigterm = procfs.raise_on_sigterm()
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    # -- where things are ------------------------------------------------------------------------

    @property
    def ports(self) -> Ports:
        if self._ports is None:
            raise LocalTritonError("free ports are chosen when the server starts")
        return self._ports

    @property
    def run_directory(self) -> Path:
        if self._run_directory is None:
            raise LocalTritonError("the run directory is made when the server starts")
        return self._run_directory

    @property
    def log_path(self) -> Path:
        """The server's log (stdout and stderr of the server and its Python stubs)."""
        if self._log_to_console:
            raise LocalTritonError("this server logs to the console")
        return self.run_directory / "tritonserver.log"

    @property
    def shared_memory_prefix(self) -> str:
        """The name prefix of the server's Python-backend regions in /dev/shm."""
        return self._shared_memory_prefix

    @property
    def device_lock_path(self) -> Path:
        return self.run_directory / "device.lock"

    @property
    def http_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.ports.http}"

    @property
    def http_address(self) -> str:
        """`host:port` as tritonclient's InferenceServerClient wants it."""
        return f"{_url_host(self.host)}:{self.ports.http}"

    @property
    def grpc_address(self) -> str:
        return f"{_url_host(self.host)}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.ports.metrics}/metrics"

    @property
    def pid(self) -> int:
        return self._require_process().pid

    @property
    def startup_seconds(self) -> float | None:
        """Seconds from `start()` to readiness, once `wait_ready()` has seen it."""
        return self._startup_seconds

    @property
    def running(self) -> bool:
        return self._process is not None and self.exit_status is None

    @property
    def exit_status(self) -> int | None:
        """The server's exit status once it exited (negative: the signal that killed it), or
        None while it runs or before it started."""
        return None if self._process is None else _exit_status(self._process.pid)

    def log_tail(self, size: int = _LOG_TAIL_BYTES) -> str:
        if self._log_to_console or self._run_directory is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - size))
            return log.read().decode(errors="replace")

    def _log_excerpt(self) -> str:
        if self._log_to_console:
            return ""
        return f"; log {self.log_path} ends with:\n{self.log_tail()}"

    def _require_process(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise LocalTritonError("the server has not been started")
        return self._process


# -- command line --------------------------------------------------------------------------------


class _StopRequested(Exception):
    pass


def _request_stop(signum: int, frame: types.FrameType | None) -> None:
    # A second signal must not interrupt the orderly stop that the first one began.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _StopRequested(signal.Signals(signum).name)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_harness.local_triton",
        description="Run the tritonserver of the nvidia-pytriton wheel in the foreground until "
        "SIGTERM or SIGINT, then stop it and its Python-backend stubs.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address to bind (default %(default)s)",
    )
    for name in ("--http-port", "--grpc-port", "--metrics-port"):
        parser.add_argument(
            name, type=int, default=0, metavar="PORT", help="0 picks a free port (default)"
        )
    parser.add_argument("--model-repository", type=Path, required=True, metavar="DIR")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        dest="models",
        metavar="NAME",
        help="model to load at start-up; repeat for several",
    )
    parser.add_argument(
        "--no-explicit",
        action="store_true",
        help="run in Triton's default model-control mode, which refuses load/unload requests",
    )
    parser.add_argument("--exit-timeout-secs", type=int, default=2, metavar="SECONDS")
    parser.add_argument(
        "--grpc-max-connection-age-ms",
        type=int,
        metavar="MS",
        help="end each gRPC connection (GOAWAY) after about this long, its calls finishing "
        "first, so gRPC clients reconnect (tritonserver's --grpc-max-connection-age, with a "
        "grace as long)",
    )
    parser.add_argument(
        "--repository-header",
        metavar="NAME",
        help="lock the model-repository API (and logging, trace, shared memory) to this header, "
        f"its value taken from ${REPOSITORY_TOKEN_ENV}",
    )
    parser.add_argument("--ready-timeout", type=float, default=120.0, metavar="SECONDS")
    parser.add_argument(
        "--run-directory",
        type=Path,
        metavar="DIR",
        help="for the server log and the emulated-device lock; default: a temporary directory, "
        "and the log goes to this process's stdout",
    )
    return parser


def restricted_repository_arguments(credential: tuple[str, str] | None) -> list[str]:
    """tritonserver's flags that lock its model-repository API (and the administrator's: logging,
    trace, shared memory) to a header, as manifests/triton-deployment.yaml does (none for None).
    Triton 2.51 takes `<categories>:<header>=<value>`; `model-repository,<header>=<value>` is
    refused at start-up."""
    if credential is None:
        return []
    header, value = credential
    locked = f"model-repository,logging,trace,shared-memory:{header}={value}"
    return [f"--http-restricted-api={locked}", f"--grpc-restricted-protocol={locked}"]


def grpc_age_arguments(milliseconds: int | None) -> list[str]:
    """tritonserver's flags for a gRPC max connection age (none for None)."""
    if milliseconds is None:
        return []
    return [
        f"--grpc-max-connection-age={milliseconds}",
        f"--grpc-max-connection-age-grace={milliseconds}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    credential = None
    if arguments.repository_header:
        token = os.environ.get(REPOSITORY_TOKEN_ENV, "")
        if not token:
            print(f"--repository-header needs ${REPOSITORY_TOKEN_ENV}", file=sys.stderr)
            return 2
        credential = (arguments.repository_header, token)
    server = LocalTriton(
        model_repository=arguments.model_repository,
        models=arguments.models,
        host=arguments.host,
        http_port=arguments.http_port,
        grpc_port=arguments.grpc_port,
        metrics_port=arguments.metrics_port,
        explicit_model_control=not arguments.no_explicit,
        exit_timeout_seconds=arguments.exit_timeout_secs,
        run_directory=arguments.run_directory,
        log_to_console=arguments.run_directory is None,
        extra_arguments=grpc_age_arguments(arguments.grpc_max_connection_age_ms),
        repository_credential=credential,
    )
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    # A server that dies on its own orphans its stubs; this process exists to clean up after it.
    with adopting_orphans():
        return _serve(server, ready_timeout=arguments.ready_timeout)


def _serve(server: LocalTriton, *, ready_timeout: float) -> int:
    try:
        server.start()
        startup = server.wait_ready(ready_timeout)
        print(
            f"batchpilot_harness.local_triton: ready in {startup:.2f} s: http={server.http_url} "
            f"grpc={server.grpc_address} metrics={server.metrics_url} pid={server.pid}",
            flush=True,
        )
        status = server.wait()
        print(
            f"batchpilot_harness.local_triton: tritonserver exited with {status}", file=sys.stderr
        )
        return status or 1
    except _StopRequested as stop:
        print(f"batchpilot_harness.local_triton: {stop}, stopping", file=sys.stderr, flush=True)
        return 0
    except LocalTritonError as error:
        print(f"batchpilot_harness.local_triton: {error}", file=sys.stderr)
        return 1
    finally:
        # Nothing may interrupt the stop itself.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
