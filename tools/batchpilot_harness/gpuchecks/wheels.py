"""The wheels the GPU check needs beyond what a GPU machine has, and how they get there.

The GPU machines this project is lent have torch, numpy, nvidia-ml-py, prometheus-client,
aiohttp and PyYAML, but reach no registry: whatever else the check imports must travel with the
working tree, and the carried folder may hold about 60 MiB. What the check imports, beyond
those, is the runner's and the sidecar's own stack and Triton:

- `nvidia-pytriton`: the tritonserver binary, its Python backend and its libraries. Only its
  files are used (`batchpilot_harness.local_triton`), never its Python package, so none of its
  own dependencies travel. Its wheel (53 MiB) holds a backend stub for every Python from 3.8 to
  3.13 and, for 3.13's, a bundled libpython (13 MiB); the copy carried keeps the stub of the
  Python it is for and drops the rest (38 MiB), and says so in its name (a build tag).
- `tritonclient` with its HTTP client (geventhttpclient, gevent, ...): `batchpilot_triton.servers`.
- `pydantic`: the policy's API models, used by the runner.

Not carried: exchange-calendars and pandas (the policy core imports them only for a policy that
names a calendar), kopf and the Kubernetes client (the runner does not import them).

Versions are those of the environment that downloads them (the project's virtualenv), so the
device runs what the tests here ran. On the device, a carried distribution the environment does
not have at exactly that version is installed from the folder (`pip install --no-index
--no-deps --target`) into a directory of its own that goes first on the path; nothing is asked
of a registry. This module uses nothing outside the standard library: it runs before anything
else is installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

BUDGET_MIB = 60.0
DEFAULT_PYTHON = "3.12"
"""The lent GPU machines' Python (3.12.3 on 2026-11-27, shared/FACTS.md); `run` says so when the
carried wheels are for another."""
MANIFEST = "manifest.json"
_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Carried:
    name: str
    """The distribution, as PyPI spells it."""
    why: str


CARRIED = (
    Carried("nvidia-pytriton", "tritonserver and its Python backend (files only, trimmed)"),
    Carried("tritonclient", "the Triton client under batchpilot_triton.servers"),
    Carried("geventhttpclient", "tritonclient.http imports it"),
    Carried("gevent", "geventhttpclient"),
    Carried("greenlet", "gevent"),
    Carried("zope.event", "gevent"),
    Carried("zope.interface", "gevent"),
    Carried("brotli", "geventhttpclient"),
    Carried("certifi", "geventhttpclient"),
    Carried("urllib3", "tritonclient"),
    Carried("python-rapidjson", "tritonclient"),
    Carried("ml-dtypes", "tritonclient.utils imports it"),
    Carried("pydantic", "the policy's API models (the runner)"),
    Carried("pydantic-core", "pydantic"),
    Carried("annotated-types", "pydantic"),
    Carried("typing-inspection", "pydantic"),
    Carried("typing-extensions", "pydantic needs a newer one than torch's may be"),
)
ON_THE_DEVICE = {
    # distribution: the module the check imports from it
    "torch": "torch",
    "numpy": "numpy",
    "nvidia-ml-py": "pynvml",
    "prometheus-client": "prometheus_client",
    "aiohttp": "aiohttp",
    "pyyaml": "yaml",
}
PYTRITON = "nvidia-pytriton"


class WheelsError(Exception):
    """The wheels could not be downloaded, are not there, or do not fit."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(version_of: Callable[[str], str] = importlib.metadata.version) -> dict[str, str]:
    """The carried distributions at the versions this environment runs."""
    found = {}
    for carried in CARRIED:
        try:
            found[carried.name] = version_of(carried.name)
        except importlib.metadata.PackageNotFoundError:
            raise WheelsError(
                f"{carried.name} is not installed in this environment ({sys.executable}); "
                "download the wheels from the project's virtualenv (make venv)"
            ) from None
    return found


def platforms() -> list[str]:
    """manylinux x86_64 tags up to glibc 2.35 (what the nvidia-pytriton wheel needs)."""
    return [
        *(f"manylinux_2_{minor}_x86_64" for minor in range(35, 4, -1)),
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ]


def download_command(*, python: str, pinned: dict[str, str], dest: Path) -> list[str]:
    abi = "cp" + python.replace(".", "")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--no-deps",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        abi,
    ]
    for platform in platforms():
        command += ["--platform", platform]
    return [*command, "--dest", str(dest), *(f"{n}=={v}" for n, v in pinned.items())]


# -- trimming nvidia-pytriton ---------------------------------------------------------------------

_STUBS = "pytriton/tritonserver/python_backend_stubs/"
_BUNDLED_LIBPYTHON = re.compile(r"^nvidia_pytriton\.libs/libpython3[^/]*?\.(\d+)\.so")


def keeps(member: str, *, python: str) -> bool:
    """Whether a file of the nvidia-pytriton wheel is needed under this Python."""
    if member.startswith(_STUBS):
        return member[len(_STUBS) :].split("/", 1)[0] == python
    bundled = _BUNDLED_LIBPYTHON.match(member)
    if bundled:
        return f"3.{bundled.group(1)}" == python
    return True


def trimmed_name(wheel: str, *, python: str) -> str:
    """The file name with a build tag that says what it keeps: `...-0.7.0-1py311-py3-...`."""
    name, version, *tags = Path(wheel).name.removesuffix(".whl").split("-")
    if len(tags) == 4:  # it already has a build tag
        tags = tags[1:]
    return "-".join([name, version, "1py" + python.replace(".", ""), *tags]) + ".whl"


def trim(wheel: Path, *, python: str) -> Path:
    """A copy of the nvidia-pytriton wheel with only this Python's stub; the original is removed.
    Its RECORD lists what it keeps, so it installs like the original."""
    target = wheel.with_name(trimmed_name(wheel.name, python=python))
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w") as out:
        for info in source.infolist():
            if not keeps(info.filename, python=python):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(
                    line for line in lines if keeps(line.split(",", 1)[0], python=python)
                ).encode()
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    if target != wheel:
        wheel.unlink()
    return target


# -- the folder -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    """Canonical distribution name."""
    version: str
    size: int


def wheel_of(path: Path) -> Wheel:
    name, version = path.name.split("-")[:2]
    return Wheel(path=path, name=canonical(name), version=version, size=path.stat().st_size)


def inventory(folder: Path) -> list[Wheel]:
    return sorted((wheel_of(p) for p in folder.glob("*.whl")), key=lambda w: -w.size)


def size_report(found: Sequence[Wheel], *, budget_mib: float = BUDGET_MIB) -> str:
    total = sum(wheel.size for wheel in found)
    lines = [f"  {wheel.size / _MIB:7.2f} MiB  {wheel.path.name}" for wheel in found]
    verdict = "within" if total <= budget_mib * _MIB else "OVER"
    lines.append(
        f"  {total / _MIB:7.2f} MiB  in all, {len(found)} wheels ({total:,} bytes): {verdict} "
        f"the {budget_mib:g} MiB budget"
    )
    return "\n".join(lines)


def write_manifest(folder: Path, *, python: str, found: Sequence[Wheel]) -> None:
    manifest = {
        "python": python,
        "wheels": {
            wheel.name: {"version": wheel.version, "file": wheel.path.name} for wheel in found
        },
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@dataclasses.dataclass(frozen=True)
class Manifest:
    python: str
    versions: dict[str, str]
    """Canonical name -> version."""
    files: dict[str, str]

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        if not path.is_file():
            raise WheelsError(f"no {path}: run `make gpu-wheels` where PyPI can be reached")
        data = json.loads(path.read_text())
        wheels = data["wheels"]
        return cls(
            python=data["python"],
            versions={name: entry["version"] for name, entry in wheels.items()},
            files={name: entry["file"] for name, entry in wheels.items()},
        )


def download(*, dest: Path, python: str, budget_mib: float = BUDGET_MIB) -> list[Wheel]:
    """Download the carried wheels for `python` into `dest` (emptied of wheels first), trim
    nvidia-pytriton, write the manifest; raises WheelsError when over the budget."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    pinned = pins()
    command = download_command(python=python, pinned=pinned, dest=dest)
    done = subprocess.run(command, check=False)  # noqa: S603 -- our own argument vector
    if done.returncode != 0:
        raise WheelsError(f"pip download failed ({done.returncode}): {' '.join(command)}")
    for wheel in inventory(dest):
        if wheel.name == PYTRITON:
            trim(wheel.path, python=python)
    found = inventory(dest)
    absent = {canonical(name) for name in pinned} - {wheel.name for wheel in found}
    if absent:
        raise WheelsError(f"pip downloaded no wheel for {', '.join(sorted(absent))}")
    write_manifest(dest, python=python, found=found)
    if sum(wheel.size for wheel in found) > budget_mib * _MIB:
        raise WheelsError(f"the wheels exceed {budget_mib:g} MiB:\n{size_report(found)}")
    return found


# -- on the device --------------------------------------------------------------------------------


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def to_install(
    manifest: Manifest, *, version_of: Callable[[str], str | None] | None = None
) -> list[str]:
    """The carried distributions this environment lacks at the carried version."""
    version_of = version_of or installed_version
    return sorted(name for name, v in manifest.versions.items() if version_of(name) != v)


def missing_on_the_device(
    *, has_module: Callable[[str], bool] = lambda m: importlib.util.find_spec(m) is not None
) -> list[str]:
    """What the wheels do not carry, because the GPU machines have it, and this one lacks."""
    return [name for name, module in ON_THE_DEVICE.items() if not has_module(module)]


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install_command(*, folder: Path, site: Path, requirements: Iterable[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--disable-pip-version-check",
        "--quiet",
        "--find-links",
        str(folder),
        "--target",
        str(site),
        *requirements,
    ]


def install(folder: Path, site: Path, names: Sequence[str], manifest: Manifest) -> None:
    """Install the named carried distributions from `folder` into `site` with pip, without a
    registry. `site` is rebuilt unless it already holds exactly these wheels."""
    if importlib.util.find_spec("pip") is None:
        raise WheelsError(
            f"pip is not installed for {sys.executable}: it installs the carried wheels "
            f"({', '.join(names)}); use a Python that has pip (GPU_PYTHON=...)"
        )
    files = sorted(manifest.files[name] for name in names)
    stamp = site / ".installed"
    fingerprint = hashlib.sha256("\n".join(files).encode()).hexdigest()
    if stamp.is_file() and stamp.read_text() == fingerprint:
        return
    staging = Path(tempfile.mkdtemp(prefix=".gpu-site-", dir=site.parent))
    try:
        requirements = [f"{name}=={manifest.versions[name]}" for name in names]
        command = install_command(folder=folder, site=staging, requirements=requirements)
        done = subprocess.run(command, check=False)  # noqa: S603 -- our own argument vector
        if done.returncode != 0:
            raise WheelsError(f"installing from {folder} failed: {' '.join(command)}")
        (staging / ".installed").write_text(fingerprint)
        shutil.rmtree(site, ignore_errors=True)
        staging.rename(site)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
