"""The pod sandbox image of the real node, built here because no registry is reachable.

containerd's CRI plugin starts every Pod with a sandbox ("pause") container and would pull
``registry.k8s.io/pause`` for it. Instead ``node/pause.c`` is compiled static and put alone in a
FROM-scratch image by buildah (no daemon, vfs storage in a throwaway directory), pushed to an OCI
archive that the node imports into containerd and pins as its sandbox image. The archive's name
carries a hash of the sources, so a changed ``pause.c`` builds a new one and a current one is
reused.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from batchpilot_cluster import locations

SOURCE = Path(__file__).with_name("node") / "pause.c"
CONTAINERFILE = """\
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
"""
REPOSITORY = "localhost/batchpilot/pause"


class PauseImageError(Exception):
    pass


def tag() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + CONTAINERFILE.encode()).hexdigest()
    return digest[:12]


def image_name() -> str:
    return f"{REPOSITORY}:{tag()}"


def archive_path() -> Path:
    return locations.cache_root() / "node" / f"pause-{tag()}.oci.tar"


def _must(argv: list[str], *, env: dict[str, str] | None = None) -> None:
    completed = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if completed.returncode != 0:
        raise PauseImageError(f"{argv[0]} failed: {completed.stderr.strip()[-2000:]}")


def build() -> Path:
    """The OCI archive of the pause image, built if missing."""
    archive = archive_path()
    if archive.is_file():
        return archive
    for tool in ("gcc", "buildah"):
        if shutil.which(tool) is None:
            raise PauseImageError(f"{tool} is not installed; `make deps` installs it")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchpilot-pause-") as scratch:
        work = Path(scratch)
        context = work / "context"
        context.mkdir()
        (context / "Containerfile").write_text(CONTAINERFILE)
        # Static: the image has no libc to load a dynamic binary with.
        _must(["gcc", "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror",
               "-o", str(context / "pause"), str(SOURCE)])  # fmt: skip
        env = {**os.environ, "STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}
        storage = ["--root", str(work / "root"), "--runroot", str(work / "runroot")]
        name = image_name()
        _must(["buildah", *storage, "bud", "--quiet", "-t", name, str(context)], env=env)
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        _must(["buildah", *storage, "push", "--quiet", name, f"oci-archive:{partial}:{name}"],
              env=env)  # fmt: skip
        partial.replace(archive)
    return archive
