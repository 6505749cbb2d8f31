"""The one lock, uv.lock, and the requirement files every install reads from it.

uv resolves the product (pyproject.toml), the sidecar's distribution (sidecar/pyproject.toml)
and the tooling (tools/pyproject.toml) together, once, for the machines the project builds on
and ships to (Linux, x86_64, CPython 3.11: ``[tool.uv]`` in pyproject.toml), into uv.lock.
Nothing installs from uv.lock itself: pip does, with ``--require-hashes``, from the files under
requirements/ that ``uv export`` writes from it, one per installer (`EXPORTS`): the virtualenv
(`make venv`), what builds the project's wheels, and each image. So the virtualenv, the images and
CI carry the same versions, and a release on PyPI changes nothing until ``make lock`` takes it.

``python -m batchpilot_harness.locks write`` (``make lock``, after ``uv lock``) rewrites the
exports; ``check`` says what disagrees: pyproject.toml and the lock (``uv lock --check``, offline),
a stale export, or a package in this virtualenv at another version than the lock's.

The LLM test world's virtualenv (`llm_env`) and the NumPy 2 one (`numpy2_env`) stay out: the first
replaces vLLM's ``torch==X+cpu`` pins, which no resolver over PyPI satisfies, and the second is
NumPy 2 beside the project's NumPy 1 (nvidia-pytriton pins numpy<2); one resolution cannot hold
either. Each pins its own versions in its module.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Final

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
LOCK_FILE: Final = REPO_ROOT / "uv.lock"
HEADER: Final = (
    "# Generated from uv.lock by `make lock` (batchpilot_harness.locks); do not edit.\n"
    "# pip install --require-hashes -r {path}\n"
)
WORKSPACE_DISTRIBUTIONS: Final = frozenset({"batchpilot", "batchpilot-sidecar", "batchpilot-tools"})
"""This checkout's own distributions: installed from the working tree, never from the lock."""
UV_TIMEOUT_SECONDS: Final = 120


class LockError(RuntimeError):
    """uv is missing or failed; the message says which command and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Export:
    path: str
    """Relative to the repository root."""
    arguments: tuple[str, ...]
    """What ``uv export`` is asked for, beyond the arguments every export shares."""
    only: tuple[str, ...] = ()
    """Keep these distributions alone, without what they depend on (their own files only)."""


EXPORTS: Final = (
    # make venv: the product, the sidecar's and the tooling's dependencies, every extra and group.
    Export(
        path="requirements/dev.txt", arguments=("--all-packages", "--all-extras", "--all-groups")
    ),
    # What builds the project's wheels (--no-build-isolation), and pip itself.
    Export(
        path="requirements/build.txt",
        arguments=("--package", "batchpilot", "--only-group", "build"),
    ),
    # operator/Dockerfile: the operator-image group of pyproject.toml.
    Export(
        path="requirements/operator-image.txt",
        arguments=("--package", "batchpilot", "--only-group", "operator-image"),
    ),
    # operator/Dockerfile with --build-arg OPERATOR_REQUIREMENTS=requirements/operator-calendars.txt
    Export(
        path="requirements/operator-calendars.txt",
        arguments=("--package", "batchpilot", "--only-group", "operator-calendars"),
    ),
    # sidecar/Dockerfile: the sidecar distribution's dependencies.
    Export(
        path="requirements/sidecar-image.txt",
        arguments=("--package", "batchpilot-sidecar", "--no-default-groups"),
    ),
    # tools/batchpilot_cluster/triton.Dockerfile: numpy in the image, the server from the pytriton
    # wheel's files (its dependencies are the Python API's, which the image does not carry).
    Export(
        path="requirements/triton-image.txt",
        arguments=("--package", "batchpilot", "--only-group", "triton-image"),
        only=("numpy",),
    ),
    Export(
        path="requirements/triton-server.txt",
        arguments=("--package", "batchpilot", "--only-group", "triton-image"),
        only=("nvidia-pytriton",),
    ),
)
"""Every requirement file, by the installer that reads it."""

COMMON_ARGUMENTS: Final = (
    "export",
    "--frozen",
    "--format",
    "requirements-txt",
    "--no-emit-workspace",
    "--no-header",
)


def canonical(name: str) -> str:
    """A distribution's name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def uv() -> str:
    """The virtualenv's uv (the dev extra's, at the lock's version), else one on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if found is None:
        raise LockError("uv is not installed; `make venv` installs it from the lock")
    return found


def run_uv(arguments: Sequence[str], *, root: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(  # noqa: S603 -- fixed arguments, no user input
            [uv(), *arguments],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=UV_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise LockError(
            f"uv {' '.join(arguments[:3])}: no answer in {UV_TIMEOUT_SECONDS} s"
        ) from None


def blocks(requirements: str) -> list[str]:
    """A requirement file's entries, each with its hash and annotation lines."""
    entries: list[str] = []
    for line in requirements.splitlines(keepends=True):
        if line.strip() and not line[0].isspace() and not line.startswith("#"):
            entries.append(line)
        elif entries:
            entries[-1] += line
    return entries


def exported(export: Export, *, root: Path = REPO_ROOT) -> str:
    """The file `export` names, as ``uv export`` writes it from the lock now."""
    done = run_uv([*COMMON_ARGUMENTS, *export.arguments], root=root)
    if done.returncode != 0:
        raise LockError(f"uv export for {export.path} failed: {done.stderr.strip()[-2000:]}")
    entries = blocks(done.stdout)
    if export.only:
        wanted = {canonical(name) for name in export.only}
        entries = [entry for entry in entries if canonical(requirement_name(entry)) in wanted]
        missing = wanted - {canonical(requirement_name(entry)) for entry in entries}
        if missing:
            raise LockError(
                f"{export.path}: not in the lock's export: {', '.join(sorted(missing))}"
            )
    return HEADER.format(path=export.path) + "".join(entries)


def requirement_name(entry: str) -> str:
    return re.split(r"[=<>!~ ;\[]", entry.strip(), maxsplit=1)[0]


def pins(requirements: str) -> dict[str, str]:
    """Each pinned distribution of a requirement file and its version, by canonical name."""
    pinned: dict[str, str] = {}
    for entry in blocks(requirements):
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", entry)
        if match is None:
            raise LockError(f"not a pinned requirement: {entry.splitlines()[0]}")
        pinned[canonical(match.group(1))] = match.group(2)
    return pinned


def export_named(path: str) -> Export:
    found = next((export for export in EXPORTS if export.path == path), None)
    if found is None:
        raise LockError(f"no export {path}")
    return found


def pinned_in(path: str, *, root: Path = REPO_ROOT) -> dict[str, str]:
    """The versions a committed export pins."""
    export_named(path)
    return pins((root / path).read_text())


def write(*, root: Path = REPO_ROOT) -> list[str]:
    """Rewrite every export from the lock; the paths that changed."""
    changed: list[str] = []
    for export in EXPORTS:
        text = exported(export, root=root)
        target = root / export.path
        if not target.exists() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            changed.append(export.path)
    return changed


def lock_disagreement(*, root: Path = REPO_ROOT) -> str | None:
    """Why uv.lock does not hold what the pyproject.toml files ask for, or None when it does.
    Offline: a lock that satisfies them needs nothing from the index to say so."""
    done = run_uv(["lock", "--check", "--offline"], root=root)
    if done.returncode == 0:
        return None
    return done.stderr.strip()[-2000:] or f"uv lock --check exited {done.returncode}"


def stale_exports(*, root: Path = REPO_ROOT) -> list[str]:
    """The committed exports that differ from what the lock gives now."""
    return [
        export.path
        for export in EXPORTS
        if not (root / export.path).exists()
        or (root / export.path).read_text() != exported(export, root=root)
    ]


def installed() -> dict[str, str]:
    """This interpreter's distributions and versions, by canonical name."""
    return {
        canonical(distribution.metadata["Name"]): distribution.version
        for distribution in metadata.distributions()
    }


def differences(
    *, locked: Mapping[str, str], present: Mapping[str, str], own: frozenset[str] = frozenset()
) -> list[str]:
    """How `present` differs from `locked`, one line each: a version other than the lock's, a
    locked package missing, a package the lock does not hold (`own` distributions aside)."""
    lines = [
        f"{name}: {present[name]} installed, the lock has {version}"
        for name, version in sorted(locked.items())
        if name in present and present[name] != version
    ]
    lines += [
        f"{name}: missing (the lock has {locked[name]})"
        for name in sorted(set(locked) - set(present))
    ]
    lines += [
        f"{name}: {present[name]} installed, not in the lock"
        for name in sorted(set(present) - set(locked) - own)
    ]
    return lines


def venv_differences() -> list[str]:
    return differences(
        locked=pinned_in("requirements/dev.txt"), present=installed(), own=WORKSPACE_DISTRIBUTIONS
    )


def prune_venv() -> list[str]:
    """Uninstall what this virtualenv holds beyond the lock (pip installs, never removes)."""
    extra = sorted(
        set(installed()) - set(pinned_in("requirements/dev.txt")) - WORKSPACE_DISTRIBUTIONS
    )
    if extra:
        subprocess.run(  # noqa: S603 -- names from this virtualenv's own metadata
            [sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", *extra],
            check=True,
            timeout=UV_TIMEOUT_SECONDS,
        )
    return extra


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchpilot_harness.locks", description=__doc__)
    parser.add_argument(
        "action",
        choices=("write", "check", "prune-venv"),
        help="write: the exports from uv.lock; check: the lock, the exports and this virtualenv "
        "against each other; prune-venv: uninstall what the lock does not hold",
    )
    arguments = parser.parse_args(argv)
    try:
        if arguments.action == "write":
            for path in write():
                print(f"wrote {path}")
            return 0
        if arguments.action == "prune-venv":
            for name in prune_venv():
                print(f"uninstalled {name} (not in the lock)")
            return 0
        problems = [f"uv.lock: {reason}" for reason in filter(None, [lock_disagreement()])]
        problems += [f"{path}: stale (make lock)" for path in stale_exports()]
        problems += [f"virtualenv: {line}" for line in venv_differences()]
    except LockError as error:
        print(f"locks: {error}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
