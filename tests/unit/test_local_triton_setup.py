"""What LocalTriton prepares before it starts a server: backend directory, environment, ports."""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import sysconfig
from pathlib import Path

import pytest

from batchpilot_harness import local_triton


@pytest.fixture
def distribution() -> local_triton.TritonDistribution:
    try:
        return local_triton.find_distribution()
    except local_triton.LocalTritonError as error:
        pytest.skip(str(error))


def test_backend_directory_is_built_in_our_cache_with_this_pythons_stub(
    distribution: local_triton.TritonDistribution, tmp_path: Path
) -> None:
    backend_directory = local_triton.prepare_backend_directory(distribution, cache=tmp_path)

    python_backend = backend_directory / "python"
    assert backend_directory.is_relative_to(tmp_path / "triton-backends" / distribution.version)
    assert sorted(p.name for p in python_backend.iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]
    stub = python_backend / "triton_python_backend_stub"
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert stub.read_bytes() == distribution.stub_for(python_version).read_bytes()
    assert os.access(stub, os.X_OK)
    assert not list(backend_directory.parent.glob(".staging-*"))


def test_backend_directory_is_reused_once_built(
    distribution: local_triton.TritonDistribution, tmp_path: Path
) -> None:
    first = local_triton.prepare_backend_directory(distribution, cache=tmp_path)
    built_at = (first / "python" / "triton_python_backend_stub").stat().st_mtime_ns

    second = local_triton.prepare_backend_directory(distribution, cache=tmp_path)

    assert second == first
    assert (second / "python" / "triton_python_backend_stub").stat().st_mtime_ns == built_at


def test_cache_root_is_the_environment_s_folder_or_else_under_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(local_triton.CACHE_ENV, str(tmp_path))
    assert local_triton.cache_root() == tmp_path
    monkeypatch.delenv(local_triton.CACHE_ENV)
    assert local_triton.cache_root() == Path.home() / ".cache" / "batchpilot"


def test_environment_makes_the_stub_use_this_interpreter_and_its_packages(
    distribution: local_triton.TritonDistribution, tmp_path: Path
) -> None:
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", "KEEP": "me"}

    environment = local_triton.server_environment(
        distribution, base=base, device_lock=tmp_path / "device.lock"
    )

    library_path = environment["LD_LIBRARY_PATH"].split(os.pathsep)
    assert library_path[0] == str(distribution.shared_libraries)
    assert library_path[-1] == "/opt/lib"
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        assert str(sysconfig.get_config_var("LIBDIR")) in library_path
    assert environment["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]
    assert environment[local_triton.DEVICE_LOCK_ENV] == str(tmp_path / "device.lock")
    assert environment["KEEP"] == "me"
    assert base == {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", "KEEP": "me"}


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = local_triton.free_ports("127.0.0.1", 3)

    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("host", "url_host"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("10.244.0.7", "10.244.0.7"),
        ("::", "[::1]"),
        ("::1", "[::1]"),
        ("localhost", "localhost"),
    ],
)
def test_urls_reach_the_bound_address_from_this_machine(host: str, url_host: str) -> None:
    server = local_triton.LocalTriton(
        model_repository=Path("."), host=host, http_port=8000, grpc_port=8001, metrics_port=8002
    )

    assert server.http_url == f"http://{url_host}:8000"
    assert server.metrics_url == f"http://{url_host}:8002/metrics"


def test_unknown_model_is_refused_before_anything_starts(tmp_path: Path) -> None:
    server = local_triton.LocalTriton(model_repository=tmp_path, models=["missing"])

    with pytest.raises(local_triton.LocalTritonError, match="no model 'missing'"):
        server.start()
    assert not server.running


def child_subreaper() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(-1)
    assert libc.prctl(37, ctypes.byref(value), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return value.value


def test_orphans_are_adopted_only_while_asked_for() -> None:
    before = child_subreaper()

    with local_triton.adopting_orphans():
        assert child_subreaper() == 1

    assert child_subreaper() == before
