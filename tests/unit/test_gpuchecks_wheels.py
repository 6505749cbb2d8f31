"""What the GPU check carries to a GPU machine: exactly the distributions its imports need beyond
what such a machine has, nvidia-pytriton trimmed to one Python, within the size budget; and how
they are installed there without a registry."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from batchpilot_harness.gpuchecks import wheels

REPO = Path(__file__).resolve().parents[2]
CARRIED = {wheels.canonical(c.name) for c in wheels.CARRIED}
# The markers of the GPU machines' Python.
ENVIRONMENT = {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "implementation_name": "cpython",
    "os_name": "posix",
}
# Where tritonclient is asked for, it is with its HTTP client.
EXTRAS = {"tritonclient": ("http",)}


def requirements(name: str) -> set[str]:
    extras = ("", *EXTRAS.get(wheels.canonical(name), ()))
    found = set()
    for text in importlib.metadata.requires(name) or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({**ENVIRONMENT, "extra": e}) for e in extras):
            found.add(wheels.canonical(requirement.name))
    return found


def on_the_device() -> set[str]:
    """What the GPU machines have: the named packages and everything they require."""
    found: set[str] = set()
    pending = [wheels.canonical(name) for name in wheels.ON_THE_DEVICE]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending += requirements(name)
    return found


@pytest.mark.parametrize("carried", sorted(CARRIED - {wheels.PYTRITON}))
def test_what_a_carried_distribution_requires_is_carried_or_on_the_device(carried: str) -> None:
    assert requirements(carried) <= CARRIED | on_the_device()


def test_nvidia_pytriton_is_carried_for_its_files_only() -> None:
    # Its Python package (and so its long list of requirements) is never imported.
    code = (REPO / "tools" / "batchpilot_harness" / "local_triton.py").read_text()
    assert "import pytriton" not in code
    assert 'find_spec("pytriton")' in code


def test_the_checks_processes_import_nothing_that_is_neither_carried_nor_on_the_device() -> None:
    # The check's own process (the runner, the harness) and the sidecar's.
    script = """
import json, sys
import batchpilot_harness.gpuchecks.command_line, batchpilot_harness.gpuchecks.runs
import batchpilot_sidecar.commands, batchpilot_sidecar.serving, batchpilot_sidecar.collecting
import importlib.metadata as m
ours = {"batchpilot", "batchpilot_triton", "batchpilot_sidecar", "batchpilot_harness"}
# setuptools' hook, loaded by a .pth file of virtualenvs, not by us
hooks = {"_distutils_hack"}
tops = {n.split(".")[0] for n in sys.modules} - set(sys.stdlib_module_names) - ours - hooks
owners = m.packages_distributions()
print(json.dumps({t: owners.get(t, []) for t in sorted(tops)}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    imported = json.loads(done.stdout)
    owned = {wheels.canonical(d) for owners in imported.values() for d in owners}
    assert owned <= CARRIED | on_the_device()
    # Modules of no distribution: Cython's runtime, an editable install's finder, the interpreter's.
    unowned = {name for name, owners in imported.items() if not owners}
    runtime = ("_cython_", "cython_runtime", "__editable__", "__main__", "_sysconfigdata_")
    assert all(name.startswith(runtime) for name in unowned), unowned
    for heavy in ("exchange-calendars", "pandas", "kopf", "kubernetes", "prometheus-api-client"):
        assert heavy not in owned


def test_pins_are_this_environments_versions_and_a_missing_one_is_named() -> None:
    versions = {c.name: f"1.{i}" for i, c in enumerate(wheels.CARRIED)}
    assert wheels.pins(versions.__getitem__) == versions

    def lacking(name: str) -> str:
        if name == "pydantic":
            raise importlib.metadata.PackageNotFoundError(name)
        return "1.0"

    with pytest.raises(wheels.WheelsError, match="pydantic is not installed in this environment"):
        wheels.pins(lacking)


def test_the_download_takes_binary_wheels_only_without_dependencies_for_one_python() -> None:
    command = wheels.download_command(
        python="3.11", pinned={"pydantic": "2.14.3"}, dest=Path("/tmp/w")
    )
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in command
    assert "--no-deps" in command
    assert command[command.index("--python-version") + 1] == "3.11"
    assert command[command.index("--abi") + 1] == "cp311"
    platforms = [command[i + 1] for i, part in enumerate(command) if part == "--platform"]
    assert platforms[0] == "manylinux_2_35_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(platforms)
    assert command[-3:] == ["--dest", "/tmp/w", "pydantic==2.14.3"]


STUBS = "pytriton/tritonserver/python_backend_stubs"


def fake_pytriton(folder: Path) -> Path:
    members = {
        "pytriton/tritonserver/bin/tritonserver": b"server",
        f"{STUBS}/3.10/triton_python_backend_stub": b"310",
        f"{STUBS}/3.11/triton_python_backend_stub": b"311",
        f"{STUBS}/3.13/triton_python_backend_stub": b"313",
        "nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0": b"libpython 3.13",
        "nvidia_pytriton.libs/libtritonserver-717102f0.so": b"libtritonserver",
    }
    record = "".join(f"{name},sha256=x,1\n" for name in members)
    record += "nvidia_pytriton-0.7.0.dist-info/RECORD,,\n"
    path = folder / "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
        wheel.writestr("nvidia_pytriton-0.7.0.dist-info/RECORD", record)
    return path


def test_nvidia_pytriton_keeps_only_the_stub_and_libraries_of_its_python(tmp_path: Path) -> None:
    trimmed = wheels.trim(fake_pytriton(tmp_path), python="3.11")
    assert trimmed.name == "nvidia_pytriton-0.7.0-1py311-py3-none-manylinux_2_35_x86_64.whl"
    assert [p.name for p in tmp_path.iterdir()] == [trimmed.name]
    with zipfile.ZipFile(trimmed) as wheel:
        kept = set(wheel.namelist())
        record = wheel.read("nvidia_pytriton-0.7.0.dist-info/RECORD").decode()
    assert kept == {
        "pytriton/tritonserver/bin/tritonserver",
        f"{STUBS}/3.11/triton_python_backend_stub",
        "nvidia_pytriton.libs/libtritonserver-717102f0.so",
        "nvidia_pytriton-0.7.0.dist-info/RECORD",
    }
    assert {line.split(",")[0] for line in record.splitlines()} == kept


def test_for_python_313_its_bundled_libpython_stays() -> None:
    assert wheels.keeps("nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0", python="3.13")
    assert not wheels.keeps("nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0", python="3.12")
    assert wheels.keeps(f"{STUBS}/3.12/triton_python_backend_stub", python="3.12")
    assert wheels.keeps("pytriton/__init__.py", python="3.12")


def test_a_trimmed_name_replaces_an_earlier_build_tag() -> None:
    name = "nvidia_pytriton-0.7.0-1py311-py3-none-manylinux_2_35_x86_64.whl"
    assert wheels.trimmed_name(name, python="3.12") == (
        "nvidia_pytriton-0.7.0-1py312-py3-none-manylinux_2_35_x86_64.whl"
    )


def sized(folder: Path, name: str, mib: float) -> Path:
    path = folder / name
    path.write_bytes(b"\0" * int(mib * 1024 * 1024))
    return path


def test_the_size_report_lists_every_wheel_largest_first_and_judges_the_total(
    tmp_path: Path,
) -> None:
    sized(tmp_path, "pydantic-2.14.3-py3-none-any.whl", 0.5)
    sized(tmp_path, "nvidia_pytriton-0.7.0-1py311-py3-none-manylinux_2_35_x86_64.whl", 37.5)
    found = wheels.inventory(tmp_path)
    assert [(w.name, w.version) for w in found] == [
        ("nvidia-pytriton", "0.7.0"),
        ("pydantic", "2.14.3"),
    ]
    report = wheels.size_report(found).splitlines()
    assert report[0].split() == [
        "37.50",
        "MiB",
        "nvidia_pytriton-0.7.0-1py311-py3-none-manylinux_2_35_x86_64.whl",
    ]
    assert report[-1].startswith("    38.00 MiB  in all, 2 wheels (39,845,888 bytes): within")
    assert "OVER the 30 MiB budget" in wheels.size_report(found, budget_mib=30)


def test_the_manifest_says_what_is_carried_and_the_device_installs_what_it_lacks(
    tmp_path: Path,
) -> None:
    sized(tmp_path, "pydantic-2.14.3-py3-none-any.whl", 0.01)
    sized(tmp_path, "urllib3-2.8.0-py3-none-any.whl", 0.01)
    wheels.write_manifest(tmp_path, python="3.11", found=wheels.inventory(tmp_path))
    manifest = wheels.Manifest.read(tmp_path)
    assert manifest.python == "3.11"
    assert manifest.versions == {"pydantic": "2.14.3", "urllib3": "2.8.0"}
    installed = {"pydantic": "2.14.3", "urllib3": "2.0.7"}.get
    assert wheels.to_install(manifest, version_of=installed) == ["urllib3"]
    assert wheels.to_install(manifest, version_of=lambda name: None) == ["pydantic", "urllib3"]


def test_without_a_manifest_it_says_to_run_make_gpu_wheels(tmp_path: Path) -> None:
    with pytest.raises(wheels.WheelsError, match="run `make gpu-wheels` where PyPI can be reached"):
        wheels.Manifest.read(tmp_path)


def test_what_gpu_machines_have_is_checked_not_carried() -> None:
    assert wheels.missing_on_the_device(has_module=lambda module: module != "torch") == ["torch"]
    assert not set(wheels.ON_THE_DEVICE) & CARRIED


def probe_wheel(folder: Path) -> Path:
    """A real, tiny wheel: one module."""
    info = "gpucheck_probe-1.0.dist-info"
    files = {
        "gpucheck_probe.py": "ANSWER = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / "gpucheck_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr(f"{info}/RECORD", record)
    return path


@pytest.mark.timeout(120)
def test_the_device_installs_from_the_folder_with_pip_and_no_index(tmp_path: Path) -> None:
    folder = tmp_path / "wheels"
    folder.mkdir()
    probe_wheel(folder)
    wheels.write_manifest(folder, python="3.11", found=wheels.inventory(folder))
    manifest = wheels.Manifest.read(folder)
    site = tmp_path / "site"
    wheels.install(folder, site, ["gpucheck-probe"], manifest)
    assert (site / "gpucheck_probe.py").read_text() == "ANSWER = 42\n"
    command = wheels.install_command(folder=folder, site=site, requirements=["x==1"])
    assert {"--no-index", "--no-deps", "--find-links", "--target"} <= set(command)
    # The same wheels again: nothing to do.
    (site / "gpucheck_probe.py").write_text("kept")
    wheels.install(folder, site, ["gpucheck-probe"], manifest)
    assert (site / "gpucheck_probe.py").read_text() == "kept"
