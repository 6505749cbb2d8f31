"""Build the control-plane binaries from Go modules, once per version.

Each product gets a small generated Go module under the version's cache folder that requires the
pinned release; ``go build`` then fetches and compiles it with the module and build caches kept
under the same cache root, so a second build (or one for a new patch release) is mostly cache hits.
Kubernetes itself is not meant to be a dependency: its go.mod points the ``k8s.io/*`` staging
modules at ``./staging``, so the generated module replaces each with its published ``v0.Y.Z``.
A stamp file records what every binary was built from; a build with all stamps current does nothing,
and one that finds a binary missing or stamped with another source builds that binary alone (a
cache from before kube-proxy joined the list gets kube-proxy, and keeps the rest).
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from batchpilot_cluster import locations, versions

KUBERNETES_COMMANDS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "kubectl",
    "kubelet",
)
CONTAINERD_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr")
ALL_BINARIES = ("etcd", "kwok", "helm", *KUBERNETES_COMMANDS, *CONTAINERD_COMMANDS, "crictl")
STAMP_NAME = "built.json"


class BuildError(Exception):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Product:
    """One generated Go module and the binaries built from it."""

    name: str
    module: str
    version: str
    packages: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    replaces: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tags: tuple[str, ...] = ()
    main_go: str | None = None  # for products whose upstream main cannot be built as a dependency

    @property
    def source(self) -> str:
        return f"{self.module}@{self.version}"

    @property
    def binaries(self) -> tuple[str, ...]:
        if self.main_go:
            return (self.name,)
        return tuple(package.rsplit("/", 1)[-1] for package in self.packages)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildReport:
    bin_dir: Path
    built: tuple[str, ...]
    seconds: float


def go_environment() -> dict[str, str]:
    root = locations.cache_root() / "go"
    return {
        **os.environ,
        "GOPATH": str(root / "path"),
        "GOCACHE": str(root / "build"),
        "GOMODCACHE": str(root / "mod"),
        # -modcacherw lets a plain `rm -rf` clear the cache; -mod=mod lets go fill in go.sum.
        "GOFLAGS": "-mod=mod -modcacherw -buildvcs=false",
        "GOTOOLCHAIN": "local",
        "GOWORK": "off",
        "CGO_ENABLED": "0",
    }


def go_version() -> tuple[int, ...]:
    out = subprocess.run(
        ["go", "env", "GOVERSION"], check=True, capture_output=True, text=True
    ).stdout
    return parse_go_version(out.strip().removeprefix("go"))


def parse_go_version(text: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise BuildError(f"cannot parse Go version {text!r}")
    return tuple(int(part or 0) for part in match.groups())


def downloaded_module(module: str, version: str, *, env: Mapping[str, str]) -> dict[str, str]:
    """`go mod download -json` of a published module version: its Dir, GoMod, Sum, ..."""
    locations.cache_root().mkdir(parents=True, exist_ok=True)
    completed = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        check=False,
        capture_output=True,
        text=True,
        env=dict(env),
        cwd=locations.cache_root(),
    )
    try:
        answer = json.loads(completed.stdout)
    except json.JSONDecodeError:
        answer = {}
    if completed.returncode != 0 or "Error" in answer:
        reason = answer.get("Error") or completed.stderr.strip()
        raise BuildError(f"cannot download {module}@{version}: {reason}")
    return {str(key): str(value) for key, value in answer.items() if isinstance(value, str)}


def downloaded_go_mod(module: str, version: str, *, env: Mapping[str, str]) -> str:
    """The go.mod of a published module version, via the module cache."""
    return Path(downloaded_module(module, version, env=env)["GoMod"]).read_text()


def go_directive(go_mod: str) -> str:
    match = re.search(r"^go\s+(\S+)", go_mod, flags=re.MULTILINE)
    if not match:
        raise BuildError("go.mod has no go directive")
    return match.group(1)


def staging_modules(go_mod: str) -> list[str]:
    """The modules that k8s.io/kubernetes replaces with its own ./staging copies."""
    return sorted(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/", go_mod, re.MULTILINE))


def kubernetes_product(go_mod: str) -> Product:
    minor = versions.KUBERNETES.split(".")[1]
    patch = versions.KUBERNETES.split(".")[2]
    staging_version = f"v0.{minor}.{patch}"
    return Product(
        name="kubernetes",
        module="k8s.io/kubernetes",
        version=versions.KUBERNETES,
        packages=tuple(f"k8s.io/kubernetes/cmd/{command}" for command in KUBERNETES_COMMANDS),
        ldflags=(
            f"-X k8s.io/component-base/version.gitVersion={versions.KUBERNETES}",
            "-X k8s.io/component-base/version.gitMajor=1",
            f"-X k8s.io/component-base/version.gitMinor={minor}",
            "-X k8s.io/component-base/version.gitTreeState=clean",
        ),
        replaces={module: staging_version for module in staging_modules(go_mod)},
    )


ETCD_MAIN = """\
// Generated: etcd's own main module cannot be a dependency (it has replace directives).
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
\tetcdmain.Main(os.Args)
}
"""


def products(kubernetes_go_mod: str) -> list[Product]:
    return [
        Product(
            name="etcd",
            module="go.etcd.io/etcd/server/v3",
            version=versions.ETCD,
            packages=(".",),
            main_go=ETCD_MAIN,
        ),
        Product(
            name="kwok",
            module="sigs.k8s.io/kwok",
            version=versions.KWOK,
            packages=("sigs.k8s.io/kwok/cmd/kwok",),
        ),
        Product(
            name="helm",
            module="helm.sh/helm/v3",
            version=versions.HELM,
            packages=("helm.sh/helm/v3/cmd/helm",),
            ldflags=(f"-X helm.sh/helm/v3/internal/version.version={versions.HELM}",),
        ),
        kubernetes_product(kubernetes_go_mod),
        Product(
            name="containerd",
            module="github.com/containerd/containerd/v2",
            version=versions.CONTAINERD,
            packages=tuple(
                f"github.com/containerd/containerd/v2/cmd/{command}"
                for command in CONTAINERD_COMMANDS
            ),
            ldflags=(
                f"-X github.com/containerd/containerd/v2/version.Version={versions.CONTAINERD}",
            ),
            # The btrfs snapshotter needs cgo (libbtrfs headers); the node uses overlayfs.
            tags=("no_btrfs",),
        ),
        Product(
            name="cri-tools",
            module="sigs.k8s.io/cri-tools",
            version=versions.CRI_TOOLS,
            packages=("sigs.k8s.io/cri-tools/cmd/crictl",),
            ldflags=(f"-X sigs.k8s.io/cri-tools/pkg/version.Version={versions.CRI_TOOLS}",),
        ),
    ]


def render_go_mod(product: Product, *, go: str) -> str:
    lines = [
        f"// Generated by tools/batchpilot_cluster/building.py to build {product.source}.",
        f"module batchpilot.dev/e2e/build/{product.name}",
        "",
        f"go {go}",
        "",
        f"require {product.module} {product.version}",
    ]
    if product.replaces:
        lines += ["", "replace ("]
        lines += [
            f"\t{module} => {module} {version}" for module, version in product.replaces.items()
        ]
        lines += [")"]
    return "\n".join(lines) + "\n"


def read_stamps(bin_dir: Path) -> dict[str, str]:
    try:
        loaded = json.loads((bin_dir / STAMP_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {str(key): str(value) for key, value in loaded.items()}


def write_stamps(bin_dir: Path, stamps: Mapping[str, str]) -> None:
    tmp = bin_dir / f"{STAMP_NAME}.tmp"
    tmp.write_text(json.dumps(dict(sorted(stamps.items())), indent=2) + "\n")
    tmp.replace(bin_dir / STAMP_NAME)


def stale_binaries(product: Product, *, bin_dir: Path, stamps: Mapping[str, str]) -> list[str]:
    """The product's binaries that are missing or were built from another source."""
    return [
        binary
        for binary in product.binaries
        if stamps.get(binary) != product.source or not (bin_dir / binary).is_file()
    ]


def narrowed(product: Product, binaries: Sequence[str]) -> Product:
    """The product with only the packages of these binaries: a cache built before a command
    joined the list (kube-proxy) builds that command alone. A generated main builds whole."""
    if product.main_go:
        return product
    wanted = [package for package in product.packages if package.rsplit("/", 1)[-1] in binaries]
    return dataclasses.replace(product, packages=tuple(wanted))


def build_product(product: Product, *, bin_dir: Path, go: str, env: Mapping[str, str]) -> None:
    module_dir = locations.version_root() / "src" / product.name
    module_dir.mkdir(parents=True, exist_ok=True)
    (module_dir / "go.mod").write_text(render_go_mod(product, go=go))
    if product.main_go:
        (module_dir / "main.go").write_text(product.main_go)
    output = str(bin_dir / product.name) if product.main_go else f"{bin_dir}/"
    # -s -w: no symbol tables or DWARF; the binaries are for running, not debugging.
    ldflags = " ".join(("-s", "-w", *product.ldflags))
    tags = ["-tags", ",".join(product.tags)] if product.tags else []
    argv = ["go", "build", "-trimpath", *tags, "-ldflags", ldflags, "-o", output]
    argv += product.packages
    print(f"building {product.source} -> {', '.join(product.binaries)}", flush=True)
    started = time.monotonic()
    completed = subprocess.run(argv, cwd=module_dir, env=dict(env), check=False)
    if completed.returncode != 0:
        raise BuildError(f"go build of {product.source} failed (exit {completed.returncode})")
    print(f"built {product.name} in {time.monotonic() - started:.0f} s", flush=True)


def newer_go(first: str, second: str) -> str:
    """The later of two go directives: a module may not declare less than what it requires."""
    return max(first, second, key=parse_go_version)


def check_go_directive(go_mod: str, *, what: str) -> None:
    required = go_directive(go_mod)
    if parse_go_version(required) > go_version():
        raise BuildError(f"{what} needs go {required}; this Go is older (GOTOOLCHAIN=local)")


def build(*, force: bool = False, only: Collection[str] | None = None) -> BuildReport:
    """Every binary (or `only` these) that is missing or stale; the kind path with a registry's
    node image needs helm and kubectl alone."""
    if shutil.which("go") is None:
        raise BuildError("the go command is not on PATH")
    started = time.monotonic()
    bin_dir = locations.bin_dir()
    bin_dir.mkdir(parents=True, exist_ok=True)
    env = go_environment()
    stamps = read_stamps(bin_dir)

    kubernetes_go_mod = downloaded_go_mod("k8s.io/kubernetes", versions.KUBERNETES, env=env)
    check_go_directive(kubernetes_go_mod, what=f"k8s.io/kubernetes {versions.KUBERNETES}")
    # Our module declares the same Go language version Kubernetes was released with.
    go = go_directive(kubernetes_go_mod)

    built: list[str] = []
    for product in products(kubernetes_go_mod):
        if force:
            stale = list(product.binaries)
        else:
            stale = stale_binaries(product, bin_dir=bin_dir, stamps=stamps)
        if only is not None:
            stale = [binary for binary in stale if binary in only]
        if not stale:
            continue
        needs = go
        if product.module != "k8s.io/kubernetes":
            upstream = downloaded_go_mod(product.module, product.version, env=env)
            check_go_directive(upstream, what=product.source)
            needs = newer_go(go, go_directive(upstream))
        wanted = narrowed(product, stale)
        build_product(wanted, bin_dir=bin_dir, go=needs, env=env)
        stamps.update(dict.fromkeys(wanted.binaries, wanted.source))
        write_stamps(bin_dir, stamps)
        built.extend(wanted.binaries)
    return BuildReport(bin_dir=bin_dir, built=tuple(built), seconds=time.monotonic() - started)


def require_binaries(names: Collection[str] = ALL_BINARIES) -> Path:
    """The bin dir, or a clear error telling how to build it (starting a cluster never builds)."""
    bin_dir = locations.bin_dir()
    stamps = read_stamps(bin_dir)
    missing = [name for name in names if name not in stamps or not (bin_dir / name).is_file()]
    if missing:
        raise BuildError(
            f"missing {', '.join(missing)} in {bin_dir}; run `python -m batchpilot_cluster build`"
        )
    return bin_dir
