"""A virtualenv whose NumPy is 2.x over the project's own packages: `make numpy2-env`.

The `nvidia-pytriton` wheel pins numpy<2, so the project's virtualenv has NumPy 1, while the lent
GPU machines have NumPy 2 (2.5.2 on 2026-11-27), and the Python-backend stub of Triton 2.51
mis-sized every output array NumPy 2 made: all requests of the first GPU check failed. Tests run a
real Triton, and the GPU check, in this environment so that cannot come back unseen.

It is a small virtualenv of its own (NumPy alone, about 20 MB) whose `.pth` file adds the
project's site-packages after its own: everything else (torch, aiohttp, the product, editable)
is the project's, and NumPy is 2.x. The local Triton's stub adopts the virtualenv of the
interpreter it is given (`local_triton.LocalTriton(interpreter=...)`), so models see NumPy 2 too.
Built once per NumPy version and project virtualenv; a marker written last says it is complete,
and a lock keeps two builds apart.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from batchpilot_harness import local_triton

NUMPY_VERSION = "2.4.6"
"""The newest NumPy 2 for Python 3.11 on PyPI here; the GPU machines' 2.5 needs Python 3.12."""
ENVIRONMENT_ENV = "BATCHPILOT_NUMPY2_ENV"
"""Use this virtualenv instead of the cached one (its NumPy must be 2.x)."""


class Numpy2EnvironmentError(RuntimeError):
    pass


def project_site() -> Path:
    """This interpreter's site-packages: the project virtualenv's, when run from it."""
    return Path(sysconfig.get_path("purelib"))


def environment_dir() -> Path:
    configured = os.environ.get(ENVIRONMENT_ENV)
    if configured:
        return Path(configured)
    digest = hashlib.sha1(str(project_site()).encode()).hexdigest()[:8]  # noqa: S324 -- a name
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return local_triton.cache_root() / "numpy2" / f"numpy-{NUMPY_VERSION}-py{version}-{digest}"


def python(environment: Path | None = None) -> Path:
    return (environment or environment_dir()) / "bin" / "python"


def is_built(environment: Path | None = None) -> bool:
    return ((environment or environment_dir()) / ".complete").is_file() or (
        ENVIRONMENT_ENV in os.environ
    )


def build(*, say: Callable[[str], None] = print) -> Path:
    """The environment, built first if it is not there yet."""
    target = environment_dir()
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(target):
            _build(target, say)
    return target


def _run(argv: Sequence[str], say: Callable[[str], None]) -> str:
    say("  $ " + " ".join(argv[:6]) + (" ..." if len(argv) > 6 else ""))
    completed = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
    if completed.returncode != 0:
        raise Numpy2EnvironmentError(
            f"{argv[0]} {' '.join(argv[1:4])} failed ({completed.returncode}):\n"
            f"{(completed.stdout + completed.stderr)[-3000:]}"
        )
    return completed.stdout


def _build(target: Path, say: Callable[[str], None]) -> None:
    started = time.monotonic()
    say(f"building the NumPy {NUMPY_VERSION} environment over {project_site()} in {target}")
    try:
        # Built where it will live: its scripts name their interpreter by path.
        shutil.rmtree(target, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(target)], say)
        pip = [str(python(target)), "-m", "pip", "--disable-pip-version-check", "--quiet"]
        _run([*pip, "install", f"numpy=={NUMPY_VERSION}"], say)
        own_site = Path(
            _run(
                [
                    str(python(target)),
                    "-c",
                    "import sysconfig; print(sysconfig.get_path('purelib'))",
                ],
                say,
            ).strip()
        )
        # addsitedir, not a bare path: the project's own .pth files (its editable installs) count.
        (own_site / "zz_batchpilot_project.pth").write_text(
            f"import site; site.addsitedir({str(project_site())!r})\n"
        )
        found = _run(
            [
                str(python(target)),
                "-c",
                "import numpy, torch, batchpilot; print(numpy.__version__)",
            ],
            say,
        ).strip()
        if not found.startswith("2."):
            raise Numpy2EnvironmentError(f"{target} imports NumPy {found}, not 2.x")
        (target / ".complete").write_text(f"numpy=={found} over {project_site()}\n")
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    say(f"NumPy 2 environment ready in {time.monotonic() - started:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.parse_args(argv)
    try:
        print(build())
    except Numpy2EnvironmentError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
