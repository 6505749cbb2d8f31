"""A Python image for Pods on the cluster's real node, which can pull nothing.

The project's images (``python -m batchpilot_cluster images``) leave OCI archives and a
``current.json``
naming them under ``${BATCHPILOT_CACHE:-~/.cache/batchpilot}/images``; their Debian-made base
has the Python a test Pod needs, and the sidecar image is built on it. Where neither was built
yet, a minimal image is made from this host's Debian ``python3.11``: the interpreter, the
libraries ``ldd`` names and the standard library, FROM scratch, by buildah. Its tag is a hash of
that interpreter, so it is built once per Python.
"""

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from batchpilot_cluster import locations

PREFERRED = ("batchpilot-base", "batchpilot-sidecar")
"""Images of the images helper with python3 on PATH, best first."""
HOST_PYTHON = Path("/usr/bin/python3.11")
HOST_STDLIB = Path("/usr/lib/python3.11")
LEFT_OUT = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data")
CONTAINERFILE = """\
FROM scratch
COPY rootfs/ /
USER 65532:65532
ENV PATH=/usr/bin
ENTRYPOINT ["/usr/bin/python3"]
"""


RECIPE = "interpreter, its and its extension modules' libraries, stdlib"
"""Part of the tag: a change to what goes in builds a new image."""


class NodeImageError(Exception):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeImage:
    reference: str
    archive: Path


def images_root() -> Path:
    return locations.cache_root() / "images"


def built_by_images_helper() -> NodeImage | None:
    try:
        current = json.loads((images_root() / "current.json").read_text())
    except (OSError, ValueError):
        return None
    for name in PREFERRED:
        entry = current.get(name) if isinstance(current, dict) else None
        if isinstance(entry, dict) and Path(str(entry.get("archive"))).is_file():
            return NodeImage(reference=str(entry["reference"]), archive=Path(entry["archive"]))
    return None


def _must(argv: list[str], *, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise NodeImageError(f"{argv[0]} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries ldd resolves for the binary, and the loader."""
    found = []
    for line in _must(["ldd", str(binary)]).splitlines():
        match = re.search(r"(/\S+)\s+\(0x", line)
        if match:
            found.append(Path(match.group(1)))
    return found


def _copy_into(rootfs: Path, path: Path) -> None:
    target = rootfs / path.relative_to("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path.resolve(), target)


def minimal_python() -> NodeImage:
    """The fallback: this host's Debian python3.11 alone in an image (built once)."""
    if not HOST_PYTHON.is_file() or shutil.which("buildah") is None:
        raise NodeImageError(f"needs {HOST_PYTHON} (Debian python3.11) and buildah")
    recipe = (CONTAINERFILE + RECIPE).encode()
    tag = hashlib.sha256(HOST_PYTHON.read_bytes() + recipe).hexdigest()[:12]
    reference = f"localhost/batchpilot/node-python:{tag}"
    archive = locations.cache_root() / "node" / f"node-python-{tag}.oci.tar"
    if archive.is_file():
        return NodeImage(reference=reference, archive=archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchpilot-node-python-") as scratch:
        context = Path(scratch) / "context"
        rootfs = context / "rootfs"
        # The interpreter's libraries and its extension modules' (ssl, ctypes, ...).
        binaries = [HOST_PYTHON, *sorted((HOST_STDLIB / "lib-dynload").glob("*.so"))]
        libraries = {library for binary in binaries for library in _libraries(binary)}
        for path in (HOST_PYTHON, *sorted(libraries)):
            _copy_into(rootfs, path)
        (rootfs / "usr/bin/python3").symlink_to("python3.11")
        shutil.copytree(
            HOST_STDLIB,
            rootfs / HOST_STDLIB.relative_to("/"),
            symlinks=True,
            ignore=shutil.ignore_patterns(*LEFT_OUT, "__pycache__", "site-packages"),
        )
        (context / "Containerfile").write_text(CONTAINERFILE)
        env = {**os.environ, "STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}
        storage = ["--root", f"{scratch}/root", "--runroot", f"{scratch}/runroot"]
        _must(["buildah", *storage, "bud", "--quiet", "-t", reference, str(context)], env=env)
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        _must(["buildah", *storage, "push", "--quiet", reference,
               f"oci-archive:{partial}:{reference}"], env=env)  # fmt: skip
        partial.replace(archive)
    return NodeImage(reference=reference, archive=archive)


def python_image() -> NodeImage:
    return built_by_images_helper() or minimal_python()
