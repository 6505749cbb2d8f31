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

import hashlib
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from batchpilot_harness import cached_envs, local_triton

NUMPY_VERSION = "2.4.6"
"""The newest NumPy 2 for Python 3.11 on PyPI here; the GPU machines' 2.5 needs Python 3.12."""
ENVIRONMENT_ENV = "BATCHPILOT_NUMPY2_ENV"
"""Use this virtualenv instead of the cached one (its NumPy must be 2.x)."""


class Numpy2EnvironmentError(cached_envs.EnvironmentBuildError):
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
    return cached_envs.build_once(environment_dir(), is_built=is_built, build=_build, say=say)


def _run(argv: Sequence[str], say: Callable[[str], None]) -> str:
    return cached_envs.run_step(argv, say, error=Numpy2EnvironmentError)


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
    return cached_envs.command(build, __doc__.splitlines()[0] if __doc__ else None, argv)


if __name__ == "__main__":
    sys.exit(main())
