"""The project's container images, built here without a Docker engine or a registry.

``python -m batchpilot_cluster images`` (``make images``) builds the operator, the sidecar and the
CPU
Triton image from the same Dockerfiles a Docker user builds, and leaves each as an OCI archive that
containerd imports (``ctr -n k8s.io images import``). Two things stand in for what a registry
gives a Docker user:

- The bases. ``python:3.11-slim`` cannot be pulled, so mmdebstrap makes two from Debian bookworm's
  packages. The build base (``--build-arg BASE=``) stands in for python:3.11-slim: its
  ``python3`` is 3.11, with ``pip``, ``venv`` and a shared ``libpython`` as in the official image
  (Debian's EXTERNALLY-MANAGED marker removed, so ``pip install`` installs system-wide as it does
  there); the Triton image runs on it, and the operator's and sidecar's images build on it. The
  runtime base (``--build-arg RUNTIME_BASE=``) is what those two run on, distroless: Python 3.11,
  the libraries it links, the CA certificates and the time zone data, extracted without a shell,
  pip, apt or dpkg's database (about 42 MB against the build base's 160). The Dockerfiles' defaults
  stay ``python:3.11-slim`` for both. A base's tag is a hash of its root filesystem's tarball,
  which ``SOURCE_DATE_EPOCH`` makes reproducible for one set of package versions.
- The trust store. ``pip`` inside a ``RUN`` step reaches PyPI through the machine's egress, whose
  TLS certificates only the host's CA bundle trusts. The host's bundle is mounted read-only over
  the image's for the ``RUN`` steps only (``buildah bud --volume``); nothing of it stays in an
  image.

Builds are cached by their inputs: an image's tag is a hash of its Dockerfile, every file its
``COPY`` lines take from the context (less what its ``.dockerignore`` leaves out) and the base's
tag, and its archive is written once under ``${BATCHPILOT_CACHE:-~/.cache/batchpilot}/images/``.
A run whose inputs are unchanged builds nothing. For whoever imports them into a node's containerd,
``archive(name)`` gives the archive and reference built from this checkout's current inputs, and
``last_built(name)`` those of the last run of any checkout (``current.json`` there).
buildah runs with the vfs driver and chroot isolation (no overlay or user namespaces needed), its
storage under the same folder; each build logs to ``images/logs/<name>.log``.

What is inside each image is read back from its archive (`contents`): every Python distribution
its Dockerfile installed (by its ``*.dist-info``) with its version and the bytes its files take,
which ``make images`` prints (the largest first) and which a test compares with the lock's export
the Dockerfile installs from (requirements/); and an SBOM (CycloneDX JSON, by the maintained
``cyclonedx-py`` run over those same ``*.dist-info``) beside the archive.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from batchpilot_cluster import locations

BASE_NAME: Final = "batchpilot-base"
BASE_SUITE: Final = "bookworm"
BASE_MIRROR: Final = "http://deb.debian.org/debian"
BASE_PACKAGES: Final = (
    "python3",
    "python3-pip",
    "python3-venv",
    "python-is-python3",  # `python`, as in python:3.11-slim
    "libpython3.11",  # a shared libpython, as there; Triton's Python backend stub links it
    "ca-certificates",
)
# The runtime base: Python and what it links, no shell. libpython3.11-stdlib brings the standard
# library's C extensions and their libraries (libssl, libffi, zlib, ...); ca-certificates the CA
# bundle for TLS (assembled by a hook: nothing is configured in the extract variant); tzdata the
# time zones (a policy's `timezone`).
RUNTIME_NAME: Final = "batchpilot-runtime"
RUNTIME_PACKAGES: Final = (
    "python3.11-minimal",
    "libpython3.11-stdlib",
    "ca-certificates",
    "tzdata",
)
RUNTIME_HOOKS: Final = (
    # What the base holds, for scanners: each package's control fields in status.d, as distroless
    # images keep them (nothing is installed, so dpkg's status file stays empty).
    'mkdir -p "$1"/var/lib/dpkg/status.d && for deb in "$1"/var/cache/apt/archives/*.deb; do'
    ' dpkg-deb --field "$deb" > "$1/var/lib/dpkg/status.d/$(dpkg-deb --field "$deb" Package)";'
    " done",
    # What update-ca-certificates would write (OpenSSL's cert.pem points at it).
    'cat "$1"/usr/share/ca-certificates/mozilla/*.crt > "$1"/etc/ssl/certs/ca-certificates.crt',
    # `python3` and `python` as in the build base: the images' virtualenvs point at python3.
    'ln -s python3.11 "$1"/usr/bin/python3 && ln -s python3.11 "$1"/usr/bin/python',
    # What came as dependencies and nothing uses without a shell or a package manager: the
    # package tools and their Perl modules, openssl's command, iconv's character sets (8 MB;
    # Python's codecs are its own), the leap-second time zones, pydoc's help topics.
    'rm -rf "$1"/usr/bin/dpkg* "$1"/usr/bin/debconf* "$1"/usr/bin/c_rehash "$1"/usr/bin/openssl'
    ' "$1"/usr/bin/update-alternatives "$1"/bin/tar "$1"/usr/share/perl5 "$1"/usr/share/debconf'
    ' "$1"/usr/share/lintian "$1"/usr/lib/x86_64-linux-gnu/gconv "$1"/usr/share/zoneinfo/right'
    ' "$1"/usr/lib/python3.11/pydoc_data',
    # The loader's cache, as ldconfig would leave it after an install.
    'ldconfig -r "$1"',
)
PATH_EXCLUSIONS: Final = (
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
)
# A fixed clock for mmdebstrap: the same packages give the same tarball, hence the same tag.
BASE_SOURCE_DATE_EPOCH: Final = "1700000000"
BASE_ENVIRONMENT: Final = (
    "LANG=C.UTF-8",
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
)

HOST_CA_BUNDLE: Final = Path("/etc/ssl/certs/ca-certificates.crt")
REFERENCE_DOMAIN: Final = "localhost"
TAG_LENGTH: Final = 16
# Bumped when the way an image is built changes in a way its inputs do not show.
RECIPE_VERSION: Final = "1"

# Archives kept per image: the newest few, so checkouts a few commits apart sharing the cache
# each find theirs, and edits do not pile up hundreds of megabytes each.
KEPT_ARCHIVES: Final = 3

BASE_TIMEOUT_SECONDS: Final = 1200
BUILD_TIMEOUT_SECONDS: Final = 1800
STEP_TIMEOUT_SECONDS: Final = 600


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageRecipe:
    name: str
    dockerfile: str  # relative to the context, the repository root
    requirements: str = ""
    """The lock's export the Dockerfile installs from (relative to the context)."""
    site_packages: str = ""
    """Where in the image the Dockerfile installs Python distributions (no leading slash)."""
    own: tuple[str, ...] = ()
    """The distributions built from this checkout (not from the lock)."""


IMAGES: Final = (
    ImageRecipe(
        name="batchpilot-operator",
        dockerfile="operator/Dockerfile",
        requirements="requirements/operator-image.txt",
        site_packages="opt/batchpilot/lib/python3.11/site-packages",
        own=("batchpilot",),
    ),
    ImageRecipe(
        name="batchpilot-sidecar",
        dockerfile="sidecar/Dockerfile",
        requirements="requirements/sidecar-image.txt",
        site_packages="opt/batchpilot/lib/python3.11/site-packages",
        own=("batchpilot-sidecar",),
    ),
    ImageRecipe(
        name="batchpilot-triton",
        dockerfile="tools/batchpilot_cluster/triton.Dockerfile",
        requirements="requirements/triton-image.txt",
        site_packages="usr/local/lib/python3.11/dist-packages",
    ),
)
"""The images that run Python, by the names their references carry
(``localhost/<name>:<input hash>``)."""
MODEL_REPOSITORY_IMAGE: Final = ImageRecipe(
    name="batchpilot-model-repository",
    dockerfile="manifests/model-repository.Dockerfile",
)
"""The sample model repository as an image of files alone (``FROM scratch``), for a Pod's image
volume: Triton replicas on any node read it, as they would a model image from a registry."""
ALL_IMAGES: Final = (*IMAGES, MODEL_REPOSITORY_IMAGE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuiltImage:
    name: str
    reference: str
    archive: Path
    image_bytes: int
    archive_bytes: int
    build_seconds: float
    cached: bool

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "reference": self.reference,
            "archive": str(self.archive),
            "image_bytes": self.image_bytes,
            "archive_bytes": self.archive_bytes,
            "build_seconds": round(self.build_seconds, 1),
        }

    @classmethod
    def from_json(cls, document: Mapping[str, object], *, cached: bool) -> BuiltImage:
        return cls(
            name=str(document["name"]),
            reference=str(document["reference"]),
            archive=Path(str(document["archive"])),
            image_bytes=int(str(document["image_bytes"])),
            archive_bytes=int(str(document["archive_bytes"])),
            build_seconds=float(str(document["build_seconds"])),
            cached=cached,
        )


class ImageError(Exception):
    """One image (or the base) could not be built; the message names it and its log file."""


def images_root() -> Path:
    return locations.cache_root() / "images"


def logs_dir() -> Path:
    return images_root() / "logs"


def archive_path(name: str, tag: str) -> Path:
    return images_root() / f"{name}-{tag}.oci.tar"


def reference(name: str, tag: str) -> str:
    return f"{REFERENCE_DOMAIN}/{name}:{tag}"


def archive(
    name: str, *, context: Path = locations.REPO_ROOT, recipes: Sequence[ImageRecipe] = ALL_IMAGES
) -> BuiltImage:
    """The archive and reference of image `name` built from this checkout's current inputs, for
    ``ctr -n k8s.io images import <archive>``; pods then name the reference. Builds nothing."""
    recipe = next((recipe for recipe in recipes if recipe.name == name), None)
    if recipe is None:
        raise ImageError(f"unknown images: {name}")
    bases: dict[str, str] = {}
    for base in BASES:
        tarball = base.tarball_path()
        if not tarball.exists():
            raise ImageError(
                f"{name}: no {base.name} built yet; run `python -m batchpilot_cluster images`"
            )
        bases[base.argument] = base_reference(base, tarball)
    tag = image_tag(recipe, context=context, bases=bases)
    built = cached_image(name, tag)
    if built is None:
        raise ImageError(
            f"{name}: not built from the current inputs ({tag}); "
            "run `python -m batchpilot_cluster images`"
        )
    return built


def last_built(name: str) -> BuiltImage:
    """What the last ``images`` run (of any checkout sharing the cache) built as `name`."""
    try:
        current = json.loads((images_root() / "current.json").read_text())
        return BuiltImage.from_json(current[name], cached=True)
    except (OSError, ValueError, KeyError) as error:
        raise ImageError(
            f"{name}: no image built yet ({error}); run `python -m batchpilot_cluster images`"
        ) from None


# --- inputs and their hashes -------------------------------------------------------------


def base_argv(output: Path) -> list[str]:
    """mmdebstrap's command line for the base's root filesystem tarball."""
    return [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        # Merged /usr as in Debian's images, without the usrmerge package (which pulls in perl).
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *PATH_EXCLUSIONS,
        '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
        BASE_SUITE,
        str(output),
        BASE_MIRROR,
    ]


def runtime_argv(output: Path) -> list[str]:
    """mmdebstrap's command line for the runtime base: the packages extracted, not installed
    (no maintainer scripts, hence no shell needed), then the hooks that do what those would."""
    return [
        "mmdebstrap",
        "--variant=extract",
        f"--include={','.join(RUNTIME_PACKAGES)}",
        *PATH_EXCLUSIONS,
        # The extract variant runs no customize hooks: these run once the packages are unpacked.
        *(f"--extract-hook={hook}" for hook in RUNTIME_HOOKS),
        BASE_SUITE,
        str(output),
        BASE_MIRROR,
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseRecipe:
    """A base image made by mmdebstrap, passed to the Dockerfiles as build argument `argument`."""

    name: str
    argument: str
    stem: str
    argv: Callable[[Path], list[str]]

    def key(self) -> str:
        """A hash of how the base is made; its tarball is cached under it."""
        recipe = [RECIPE_VERSION, BASE_SOURCE_DATE_EPOCH, *BASE_ENVIRONMENT, *self.argv(Path("-"))]
        return hashlib.sha256("\0".join(recipe).encode()).hexdigest()[:TAG_LENGTH]

    def tarball_path(self) -> Path:
        return images_root() / "base" / f"{self.stem}-{self.key()}.tar"


BUILD_BASE: Final = BaseRecipe(name=BASE_NAME, argument="BASE", stem=BASE_SUITE, argv=base_argv)
RUNTIME_BASE: Final = BaseRecipe(
    name=RUNTIME_NAME, argument="RUNTIME_BASE", stem=f"{BASE_SUITE}-runtime", argv=runtime_argv
)
BASES: Final = (BUILD_BASE, RUNTIME_BASE)


def base_recipe_key() -> str:
    """The build base's key."""
    return BUILD_BASE.key()


def copied_sources(dockerfile: str) -> list[str]:
    """The context paths a Dockerfile's ``COPY`` and ``ADD`` lines take (not ``--from`` ones)."""
    logical_lines = re.sub(r"\\\n", " ", dockerfile).splitlines()
    sources: list[str] = []
    for line in logical_lines:
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() not in ("COPY", "ADD"):
            continue
        flags: list[str] = []
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        if any(flag.startswith("--from=") for flag in flags):
            continue
        paths = [str(path) for path in json.loads(rest)] if rest.startswith("[") else rest.split()
        if len(paths) < 2:
            raise ImageError(f"cannot read the sources of: {line.strip()}")
        sources.extend(paths[:-1])
    return sources


def ignore_patterns(context: Path) -> list[str]:
    """The context's .dockerignore, in the two forms it uses: a path from the context's root
    (`.venv`) and a name at any depth (`**/__pycache__`, `**/*.pyc`)."""
    try:
        lines = (context / ".dockerignore").read_text().splitlines()
    except FileNotFoundError:
        return []
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for pattern in patterns:
        if pattern.startswith("!") or "/" in pattern.removeprefix("**/"):
            raise ImageError(f".dockerignore: {pattern!r} is a form the input hash does not read")
    return patterns


def ignored(relative: Path, patterns: Sequence[str]) -> bool:
    parts = relative.parts
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatchcase(part, pattern.removeprefix("**/")) for part in parts):
                return True
        elif fnmatch.fnmatchcase(parts[0], pattern):
            return True
    return False


def context_files(context: Path, sources: Iterable[str]) -> list[Path]:
    """Every file the sources name, relative to the context, sorted; directories recursively,
    less what the context's .dockerignore leaves out (as the build leaves it out)."""
    patterns = ignore_patterns(context)
    files: set[Path] = set()
    for source in sources:
        if any(character in source for character in "*?["):
            raise ImageError(f"{source}: wildcards in COPY sources are not hashed; name the path")
        path = (context / source).resolve()
        if not path.is_relative_to(context.resolve()) or not path.exists():
            raise ImageError(f"{source}: not in the build context {context}")
        candidates = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for candidate in candidates:
            relative = candidate.relative_to(context.resolve())
            if not ignored(relative, patterns):
                files.add(relative)
    return sorted(files)


def input_tag(
    *, context: Path, dockerfile: str, base: str, build_args: Mapping[str, str] | None = None
) -> str:
    """The tag of an image: a hash of everything its build reads."""
    text = (context / dockerfile).read_text()
    digest = hashlib.sha256()
    for part in (RECIPE_VERSION, dockerfile, text, base):
        digest.update(part.encode() + b"\0")
    for key, value in sorted((build_args or {}).items()):
        digest.update(f"{key}={value}".encode() + b"\0")
    for relative in context_files(context, copied_sources(text)):
        full = context / relative
        executable = "x" if os.access(full, os.X_OK) else "-"
        digest.update(f"{relative.as_posix()}\0{executable}\0".encode())
        digest.update(hashlib.sha256(full.read_bytes()).digest())
    return digest.hexdigest()[:TAG_LENGTH]


def unpacked_bytes(archive: Path) -> int:
    """The size of an OCI archive's layers once unpacked: gzip records each member's length in
    its last four bytes (modulo 4 GiB, more than any layer here)."""
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> tarfile.TarInfo:
            return tar.getmember(f"blobs/{digest.replace(':', '/', 1)}")

        def document(member: tarfile.TarInfo) -> dict[str, Any]:
            stream = tar.extractfile(member)
            assert stream is not None
            loaded: dict[str, Any] = json.load(stream)
            return loaded

        total = 0
        for entry in document(tar.getmember("index.json"))["manifests"]:
            for layer in document(blob(entry["digest"]))["layers"]:
                member = blob(layer["digest"])
                if not layer["mediaType"].endswith("+gzip"):
                    total += member.size
                    continue
                with archive.open("rb") as raw:
                    raw.seek(member.offset_data + member.size - 4)
                    total += int.from_bytes(raw.read(4), "little")
        return total


def layer_files(archive: Path) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    """Every regular file of an OCI archive's layers, lowest layer first, with its layer."""
    with tarfile.open(archive) as tar:
        index = tar.extractfile("index.json")
        assert index is not None
        for entry in json.load(index)["manifests"]:
            manifest = tar.extractfile(f"blobs/{entry['digest'].replace(':', '/', 1)}")
            assert manifest is not None
            for layer in json.load(manifest)["layers"]:
                stream = tar.extractfile(f"blobs/{layer['digest'].replace(':', '/', 1)}")
                assert stream is not None
                with tarfile.open(fileobj=stream, mode="r|*") as layer_tar:
                    for member in layer_tar:
                        if member.isfile():
                            yield layer_tar, member


@dataclasses.dataclass(frozen=True, kw_only=True)
class Distribution:
    name: str
    """As PyPI compares names (PEP 503)."""
    version: str
    size: int
    """The bytes of its files, bytecode compiled from them included."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageContents:
    """The Python distributions an image's Dockerfile installed, the largest first."""

    distributions: tuple[Distribution, ...]
    site_packages_bytes: int

    def versions(self) -> dict[str, str]:
        return {distribution.name: distribution.version for distribution in self.distributions}

    def to_json(self) -> dict[str, object]:
        return {
            "site_packages_bytes": self.site_packages_bytes,
            "distributions": [dataclasses.asdict(d) for d in self.distributions],
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> ImageContents:
        return cls(
            distributions=tuple(Distribution(**entry) for entry in document["distributions"]),
            site_packages_bytes=int(document["site_packages_bytes"]),
        )


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def contents(archive: Path, site_packages: str) -> ImageContents:
    """The distributions under `site_packages` in the archive: each `*.dist-info`'s name and
    version, and the bytes under the top-level names its RECORD lists."""
    prefix = site_packages.strip("/") + "/"
    sizes: dict[str, int] = {}
    metadata: dict[str, tuple[str, str]] = {}
    records: dict[str, set[str]] = {}
    for layer, member in layer_files(archive):
        path = member.name.removeprefix("./")
        if not path.startswith(prefix):
            continue
        relative = path.removeprefix(prefix)
        sizes[relative] = member.size
        folder, _, file_name = relative.partition("/")
        if not folder.endswith(".dist-info") or file_name not in ("METADATA", "RECORD"):
            continue
        stream = layer.extractfile(member)
        assert stream is not None
        text = stream.read().decode("utf-8", errors="replace")
        if file_name == "METADATA":
            fields = dict(
                line.split(": ", 1) for line in text.split("\n\n")[0].splitlines() if ": " in line
            )
            metadata[folder] = (canonical_name(fields["Name"]), fields["Version"])
        else:
            listed = (line.split(",")[0] for line in text.splitlines() if line.strip())
            records[folder] = {
                entry.split("/")[0] for entry in listed if not entry.startswith("..")
            } | {folder}
    owner: dict[str, str] = {}
    for folder in sorted(records):
        for top in records[folder]:
            owner.setdefault(top, folder)
    totals = dict.fromkeys(metadata, 0)
    for relative, size in sizes.items():
        owning = owner.get(relative.split("/")[0])
        if owning in totals:
            totals[owning] += size
    distributions = sorted(
        (
            Distribution(name=name, version=version, size=totals[folder])
            for folder, (name, version) in metadata.items()
        ),
        key=lambda distribution: (-distribution.size, distribution.name),
    )
    return ImageContents(
        distributions=tuple(distributions), site_packages_bytes=sum(sizes.values())
    )


def contents_path(archive: Path) -> Path:
    return archive.with_name(archive.name.removesuffix(".oci.tar") + ".contents.json")


def sbom_path(archive: Path) -> Path:
    return archive.with_name(archive.name.removesuffix(".oci.tar") + ".cdx.json")


def recorded_contents(recipe: ImageRecipe, archive: Path) -> ImageContents:
    """The image's contents, read from its archive once and kept beside it."""
    record = contents_path(archive)
    try:
        return ImageContents.from_json(json.loads(record.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = contents(archive, recipe.site_packages)
    record.write_text(json.dumps(found.to_json(), indent=2) + "\n")
    return found


def write_sbom(recipe: ImageRecipe, archive: Path) -> Path:
    """A CycloneDX SBOM of the image's Python distributions beside its archive: cyclonedx-py
    reads an environment through its interpreter, so it is given a virtualenv that holds the
    image's `*.dist-info` folders, as they are in the image, and nothing else."""
    target = sbom_path(archive)
    if target.exists():
        return target
    beside = Path(sys.executable).parent / "cyclonedx-py"
    generator = str(beside) if beside.is_file() else shutil.which("cyclonedx-py")
    if generator is None:
        raise ImageError(f"{recipe.name}: cyclonedx-py is not installed (`make venv`)")
    prefix = recipe.site_packages.strip("/") + "/"
    log = logs_dir() / f"{recipe.name}.log"
    with tempfile.TemporaryDirectory(prefix="sbom-") as scratch:
        environment = Path(scratch) / "image"
        run_logged(
            [sys.executable, "-m", "venv", "--without-pip", str(environment)],
            what=f"{recipe.name} (SBOM)",
            log=log,
            timeout=STEP_TIMEOUT_SECONDS,
            env=os.environ,
        )
        (site,) = environment.glob("lib/python*/site-packages")
        for layer, member in layer_files(archive):
            relative = member.name.removeprefix("./").removeprefix(prefix)
            folder = relative.split("/")[0]
            if member.name.removeprefix("./").startswith(prefix) and folder.endswith(".dist-info"):
                stream = layer.extractfile(member)
                assert stream is not None
                destination = site / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(stream.read())
        staging = target.with_name(f".staging-{os.getpid()}-{target.name}")
        arguments = ["environment", "--output-reproducible", "--of", "JSON", "-o", str(staging)]
        run_logged(
            [generator, *arguments, str(environment)],
            what=f"{recipe.name} (SBOM)",
            log=log,
            timeout=STEP_TIMEOUT_SECONDS,
            # The environment's interpreter sees the image's folders alone: no PYTHONPATH.
            env={
                **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
                "SOURCE_DATE_EPOCH": BASE_SOURCE_DATE_EPOCH,
            },
        )
        staging.rename(target)
    return target


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- running the tools ---------------------------------------------------------------------


def require_tools(tools: Sequence[str] = ("buildah", "mmdebstrap")) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} is not installed (Debian package {tool}; `make deps`)")


def run_logged(
    argv: Sequence[str],
    *,
    what: str,
    log: Path,
    timeout: float,
    env: Mapping[str, str],
    capture: bool = False,
) -> str:
    """Run `argv` with its output appended to `log`; its stdout is returned instead where
    `capture` asks for it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as stream:
        stream.write(f"\n$ {shlex.join(argv)}\n")
        stream.flush()
        try:
            done = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if capture else stream,
                stderr=stream,
                text=True,
                timeout=timeout,
                env=dict(env),
                cwd=locations.REPO_ROOT,
                check=False,
            )
        except FileNotFoundError:
            raise ImageError(f"{what}: {argv[0]} is not installed (`make deps`)") from None
        except subprocess.TimeoutExpired:
            raise ImageError(f"{what}: timed out after {timeout:.0f} s; log: {log}") from None
    if done.returncode != 0:
        raise ImageError(f"{what}: {argv[0]} failed (exit {done.returncode}); log: {log}")
    return done.stdout or ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buildah:
    """buildah with its own storage, the vfs driver and chroot isolation: no daemon, no overlay
    mounts, no user namespaces."""

    root: Path

    def argv(self, *arguments: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.root / "root"),
            "--runroot",
            str(self.root / "runroot"),
            "--storage-driver",
            "vfs",
            *arguments,
        ]

    @property
    def environment(self) -> dict[str, str]:
        return {**os.environ, "STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}

    def run(
        self,
        *arguments: str,
        what: str,
        log: Path,
        timeout: float = STEP_TIMEOUT_SECONDS,
        capture: bool = False,
    ) -> str:
        return run_logged(
            self.argv(*arguments),
            what=what,
            log=log,
            timeout=timeout,
            env=self.environment,
            capture=capture,
        )

    def has_image(self, name: str) -> bool:
        done = subprocess.run(
            self.argv("inspect", "--type", "image", name),
            capture_output=True,
            env=self.environment,
            timeout=STEP_TIMEOUT_SECONDS,
            check=False,
        )
        return done.returncode == 0


def storage() -> Buildah:
    return Buildah(root=images_root() / "storage")


# --- building ------------------------------------------------------------------------------


def base_tarball(base: BaseRecipe) -> Path:
    """The base's root filesystem, made by mmdebstrap once per recipe."""
    tarball = base.tarball_path()
    if tarball.exists():
        return tarball
    log = logs_dir() / f"{base.name}.log"
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix=".staging-") as staging:
        output = Path(staging) / tarball.name
        run_logged(
            base.argv(output),
            what=f"{base.name} (mmdebstrap {BASE_SUITE})",
            log=log,
            timeout=BASE_TIMEOUT_SECONDS,
            env={**os.environ, "SOURCE_DATE_EPOCH": BASE_SOURCE_DATE_EPOCH},
        )
        output.rename(tarball)
    return tarball


def base_reference(base: BaseRecipe, tarball: Path) -> str:
    """The base's reference, tagged by its content; computed once per tarball."""
    digest_file = tarball.with_suffix(".sha256")
    if not digest_file.exists():
        digest_file.write_text(file_digest(tarball) + "\n")
    return reference(base.name, digest_file.read_text().strip()[:TAG_LENGTH])


def import_base(buildah: Buildah, tarball: Path, name: str) -> None:
    """The tarball as an image in buildah's storage, configured as python:3.11-slim is."""
    if buildah.has_image(name):
        return
    log = logs_dir() / "bases.log"
    what = f"{name} (import)"
    container = buildah.run("from", "scratch", what=what, log=log, capture=True).strip()
    try:
        buildah.run("add", "--quiet", container, str(tarball), "/", what=what, log=log)
        configuration = [argument for pair in BASE_ENVIRONMENT for argument in ("--env", pair)]
        buildah.run("config", *configuration, "--cmd", "python3", container, what=what, log=log)
        buildah.run("commit", "--quiet", container, name, what=what, log=log)
    finally:
        subprocess.run(
            buildah.argv("rm", container),
            capture_output=True,
            env=buildah.environment,
            timeout=STEP_TIMEOUT_SECONDS,
            check=False,
        )


def declared_arguments(dockerfile: str) -> list[str]:
    """The build arguments a Dockerfile declares (`ARG NAME` or `ARG NAME=default`)."""
    return re.findall(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)", dockerfile, flags=re.MULTILINE)


def build_arguments(bases: Mapping[str, str], dockerfile: str) -> dict[str, str]:
    """The bases' references, for the arguments the Dockerfile declares."""
    declared = set(declared_arguments(dockerfile))
    return {argument: value for argument, value in bases.items() if argument in declared}


def image_tag(recipe: ImageRecipe, *, context: Path, bases: Mapping[str, str]) -> str:
    arguments = build_arguments(bases, (context / recipe.dockerfile).read_text())
    return input_tag(
        context=context,
        dockerfile=recipe.dockerfile,
        base=" ".join(f"{key}={value}" for key, value in sorted(arguments.items())),
        build_args=arguments,
    )


def build_image(
    buildah: Buildah,
    recipe: ImageRecipe,
    *,
    bases: Mapping[str, str],
    tag: str,
    context: Path,
) -> BuiltImage:
    log = logs_dir() / f"{recipe.name}.log"
    log.unlink(missing_ok=True)
    name = reference(recipe.name, tag)
    started = time.monotonic()
    volumes = (
        ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"] if HOST_CA_BUNDLE.is_file() else []
    )
    declared = build_arguments(bases, (context / recipe.dockerfile).read_text())
    arguments = [f"{key}={value}" for key, value in declared.items()]
    buildah.run(
        "bud",
        "--isolation",
        "chroot",
        *(argument for pair in arguments for argument in ("--build-arg", pair)),
        *volumes,
        "--file",
        recipe.dockerfile,
        "--tag",
        name,
        str(context),
        what=recipe.name,
        log=log,
        timeout=BUILD_TIMEOUT_SECONDS,
    )
    target = archive_path(recipe.name, tag)
    staging = target.with_name(f".staging-{os.getpid()}-{target.name}")
    try:
        push = ("push", "--quiet", name, f"oci-archive:{staging}:{name}")
        buildah.run(*push, what=recipe.name, log=log)
        staging.rename(target)
    finally:
        staging.unlink(missing_ok=True)
    seconds = time.monotonic() - started
    # The archive is what counts; the storage copy (vfs: whole layers) only takes room.
    buildah.run("rmi", "--force", name, what=f"{recipe.name} (clean up)", log=log)
    buildah.run("rmi", "--prune", what=f"{recipe.name} (clean up)", log=log)
    built = BuiltImage(
        name=recipe.name,
        reference=name,
        archive=target,
        image_bytes=unpacked_bytes(target),
        archive_bytes=target.stat().st_size,
        build_seconds=seconds,
        cached=False,
    )
    target.with_suffix(".json").write_text(json.dumps(built.to_json(), indent=2) + "\n")
    return built


def cached_image(name: str, tag: str) -> BuiltImage | None:
    target = archive_path(name, tag)
    try:
        document = json.loads(target.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    return BuiltImage.from_json(document, cached=True) if target.exists() else None


def build(
    names: Sequence[str] | None = None,
    *,
    context: Path = locations.REPO_ROOT,
    recipes: Sequence[ImageRecipe] = ALL_IMAGES,
) -> list[BuiltImage]:
    """Build the base if its recipe is new, then every image whose inputs are new."""
    chosen = [recipe for recipe in recipes if names is None or recipe.name in names]
    unknown = set(names or ()) - {recipe.name for recipe in recipes}
    if unknown:
        raise ImageError(f"unknown images: {', '.join(sorted(unknown))}")
    require_tools()
    tarballs = {base.argument: base_tarball(base) for base in BASES}
    bases = {base.argument: base_reference(base, tarballs[base.argument]) for base in BASES}
    buildah = storage()
    results: list[BuiltImage] = []
    for recipe in chosen:
        tag = image_tag(recipe, context=context, bases=bases)
        built = cached_image(recipe.name, tag)
        if built is None:
            dockerfile = (context / recipe.dockerfile).read_text()
            for argument in build_arguments(bases, dockerfile):
                import_base(buildah, tarballs[argument], bases[argument])
            built = build_image(buildah, recipe, bases=bases, tag=tag, context=context)
            prune_archives(recipe.name, keep=KEPT_ARCHIVES)
        if recipe.site_packages:
            recorded_contents(recipe, built.archive)
            write_sbom(recipe, built.archive)
        results.append(built)
        record_current(built)
    return results


def prune_archives(name: str, *, keep: int) -> list[Path]:
    """Remove all but the `keep` newest archives of image `name` (and their records)."""
    pattern = re.compile(rf"{re.escape(name)}-[0-9a-f]{{{TAG_LENGTH}}}\.oci\.tar")
    archives = [path for path in images_root().iterdir() if pattern.fullmatch(path.name)]
    archives.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    for old in archives[keep:]:
        old.with_suffix(".json").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return archives[keep:]


def record_current(built: BuiltImage) -> None:
    path = images_root() / "current.json"
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError):
        current = {}
    current[built.name] = built.to_json()
    staging = path.with_name(f".staging-{os.getpid()}-current.json")
    staging.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    staging.rename(path)


def describe_contents(recipe: ImageRecipe, built: BuiltImage, *, largest: int = 8) -> str:
    """The image's Python distributions' share of it and the largest of them."""
    if not recipe.site_packages:
        return f"  files alone, no Python: {built.image_bytes / 1e3:.0f} KB unpacked"
    found = recorded_contents(recipe, built.archive)
    megabytes = 1e6
    lines = [
        f"  Python distributions: {found.site_packages_bytes / megabytes:.1f} MB in "
        f"/{recipe.site_packages} ({len(found.distributions)}); the base and the rest: "
        f"{(built.image_bytes - found.site_packages_bytes) / megabytes:.1f} MB; SBOM "
        f"{sbom_path(built.archive).name}"
    ]
    lines += [
        f"    {d.size / megabytes:6.1f} MB  {d.name} {d.version}"
        for d in found.distributions[:largest]
    ]
    return "\n".join(lines)


def recipe_named(name: str, recipes: Sequence[ImageRecipe] = ALL_IMAGES) -> ImageRecipe:
    found = next((recipe for recipe in recipes if recipe.name == name), None)
    if found is None:
        raise ImageError(f"unknown images: {name}")
    return found


def describe(built: BuiltImage) -> str:
    megabytes = 1e6
    how = (
        f"cached (built in {built.build_seconds:.0f} s)"
        if built.cached
        else f"built in {built.build_seconds:.0f} s"
    )
    return (
        f"{built.name}: {built.reference}, image {built.image_bytes / megabytes:.0f} MB, "
        f"archive {built.archive_bytes / megabytes:.0f} MB, {how}\n  {built.archive}"
    )
