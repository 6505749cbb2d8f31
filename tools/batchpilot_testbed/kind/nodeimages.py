"""A kind node image built here, for machines where no registry can give ``kindest/node``.

``kind build node-image`` cannot do it: it calls ``docker`` whatever the provider and always
pulls etcd, CoreDNS, pause, kindnetd and local-path from a registry. So the image is made the way
kind's own ``images/base/Dockerfile`` makes ``kindest/base``, from the pieces this project builds
already:

- a Debian root filesystem by mmdebstrap (systemd, iptables/nftables, runc, the CNI plugins: the
  packages kind's base installs, minus the NFS/iSCSI/fuse ones a test cluster does not use);
- kind's own base files (entrypoint, systemd units, containerd config) from the kind module;
- containerd, crictl, kubelet, kubectl from the Kubernetes/containerd builds, kubeadm beside them;
- the control plane's images as archives under ``/kind/images``, imported into the node's
  containerd by a oneshot unit before the kubelet starts (``kind build node-image`` imports them
  into a running container and commits it; an import at boot needs no engine at build time):
  one image holding kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy (with
  this host's ``nft`` and its libraries) and etcd, tagged with each name kubeadm asks for, and
  the project's own pause image.

Where the node deviates from kind's, for this machine's Podman on a cgroup v1 host (each was an
error in the probe of ../shared/FACTS.md, "kind with Podman"): containerd restricts
``oom_score_adj`` (every sandbox failed without), and the kubelet's unit makes its cgroups in the
v1 hierarchies systemd mounts after kind's entrypoint ran (hugetlb, net_cls, perf_event).
buildah builds it (no engine needed); the engine only loads the archive.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from batchpilot_cluster import building, images, locations, pauseimages, versions
from batchpilot_testbed.kind import clusters

KIND_VERSION: Final = "v0.33.0"
IMAGE_REPOSITORY: Final = "localhost/batchpilot-kind"
"""Where kubeadm looks for the control plane's images (ClusterConfiguration.imageRepository)."""
NODE_REPOSITORY: Final = f"{IMAGE_REPOSITORY}/node"
ETCD_TAG: Final = versions.ETCD
CONTROL_PLANE_COMMANDS: Final = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
)
NODE_PACKAGES: Final = (
    "systemd",
    "conntrack",
    "iptables",
    "nftables",
    "iproute2",
    "ethtool",
    "util-linux",
    "mount",
    "kmod",
    "libseccomp2",
    "bash",
    "ca-certificates",
    "procps",
    "jq",  # kind's mount-product-files.sh, the hook of every container
    "runc",
    "containernetworking-plugins",
)
NODE_BINARIES: Final = (
    "etcd",
    *building.KUBERNETES_COMMANDS,
    *building.CONTAINERD_COMMANDS,
    "crictl",
)
HOST_NFT: Final = Path("/usr/sbin/nft")
RECIPE_VERSION: Final = "1"
NODE_TIMEOUT_SECONDS: Final = 1800


class NodeImageError(Exception):
    """The node image could not be built; the message says which step and where its log is."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeImage:
    reference: str
    archive: Path


def kind_root() -> Path:
    return locations.cache_root() / "kind"


def kind_source() -> Path:
    """kind's module in the Go module cache: its base image's files come from there."""
    answer = building.downloaded_module(
        "sigs.k8s.io/kind", KIND_VERSION, env=building.go_environment()
    )
    return Path(answer["Dir"])


def kind_binary() -> Path:
    """kind, built once with the machine's Go (``go install``) into the cache."""
    directory = kind_root() / KIND_VERSION
    binary = directory / "kind"
    if not binary.is_file():
        environment = {**building.go_environment(), "GOBIN": str(directory)}
        done = subprocess.run(
            ["go", "install", f"sigs.k8s.io/kind@{KIND_VERSION}"],
            env=environment,
            cwd=locations.cache_root(),
            check=False,
        )
        if done.returncode != 0:
            raise NodeImageError(f"go install sigs.k8s.io/kind@{KIND_VERSION} failed")
    return binary


def kubeadm_binary() -> Path:
    """kubeadm of the same Kubernetes module and flags as the other binaries (kind runs it in
    the node; the local cluster does not need it, so it is built here, not by k8s-bins)."""
    directory = kind_root() / versions.KUBERNETES
    binary = directory / "kubeadm"
    if binary.is_file():
        return binary
    environment = building.go_environment()
    go_mod = building.downloaded_go_mod("k8s.io/kubernetes", versions.KUBERNETES, env=environment)
    product = dataclasses.replace(
        building.kubernetes_product(go_mod),
        name="kubeadm",
        packages=("k8s.io/kubernetes/cmd/kubeadm",),
    )
    directory.mkdir(parents=True, exist_ok=True)
    building.build_product(
        product, bin_dir=directory, go=building.go_directive(go_mod), env=environment
    )
    return binary


# --- the files --------------------------------------------------------------------------------


def rootfs_argv(output: Path) -> list[str]:
    return [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(NODE_PACKAGES)}",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        images.BASE_SUITE,
        str(output),
        images.BASE_MIRROR,
    ]


def rootfs_tarball() -> Path:
    """The node's Debian root filesystem, made once per package list."""
    key = hashlib.sha256("\0".join(rootfs_argv(Path("-"))).encode()).hexdigest()[:16]
    tarball = kind_root() / "rootfs" / f"node-{images.BASE_SUITE}-{key}.tar"
    if tarball.is_file():
        return tarball
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix=".staging-") as staging:
        output = Path(staging) / tarball.name
        images.run_logged(
            rootfs_argv(output),
            what="kind node root filesystem (mmdebstrap)",
            log=logs_dir() / "node-rootfs.log",
            timeout=NODE_TIMEOUT_SECONDS,
            env={**os.environ, "SOURCE_DATE_EPOCH": images.BASE_SOURCE_DATE_EPOCH},
        )
        output.rename(tarball)
    return tarball


def logs_dir() -> Path:
    directory = kind_root() / "logs"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def control_plane_names() -> list[str]:
    """Every reference kubeadm asks for, as ClusterConfiguration points it here."""
    names = [
        f"{IMAGE_REPOSITORY}/{command}:{versions.KUBERNETES}" for command in CONTROL_PLANE_COMMANDS
    ]
    return [*names, f"{IMAGE_REPOSITORY}/etcd:{ETCD_TAG}"]


def shared_libraries(binary: Path) -> list[Path]:
    done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeImageError(f"ldd {binary} failed: {done.stderr.strip()}")
    return [Path(match) for match in re.findall(r"(/\S+)\s+\(0x", done.stdout)]


CONTROL_PLANE_CONTAINERFILE: Final = """\
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
"""


def containerd_config(kind_config: str, *, pause: str) -> str:
    """kind's containerd config with this project's pause image and a restricted oom_score_adj
    (kind sets it only for rootless; without it every sandbox failed here: "runc create failed:
    ... can't get final child's PID from pipe: EOF")."""
    config, count = re.subn(r'sandbox_image = "[^"]*"', f'sandbox_image = "{pause}"', kind_config)
    config, more = re.subn(
        r"restrict_oom_score_adj = false", "restrict_oom_score_adj = true", config
    )
    if count != 1 or more != 1:
        raise NodeImageError("kind's containerd config changed shape: sandbox_image/oom lines")
    return config


def cri_base_spec(ctr: Path) -> str:
    """What kind's Dockerfile makes with ``ctr oci spec | jq``: containerd's default spec, with
    kind's product-files hook and without rlimits."""
    done = subprocess.run([str(ctr), "oci", "spec"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeImageError(f"ctr oci spec failed: {done.stderr.strip()}")
    spec = json.loads(done.stdout)
    hooks = spec.setdefault("hooks", {}).setdefault("createContainer", [])
    hooks.append({"path": "/kind/bin/mount-product-files.sh"})
    spec.get("process", {}).pop("rlimits", None)
    return json.dumps(spec, indent=2) + "\n"


def import_unit(archives: Sequence[str]) -> str:
    """The oneshot that puts the images into containerd before the kubelet may start."""
    tags = control_plane_names()
    steps = [
        f"ExecStart=/usr/local/bin/ctr --namespace=k8s.io images import --all-platforms "
        f"--digests --snapshotter=overlayfs /kind/images/{archive}"
        for archive in archives
    ]
    steps += [
        f"ExecStart=/usr/local/bin/ctr --namespace=k8s.io images tag --force {tags[0]} {tag}"
        for tag in tags[1:]
    ]
    return "\n".join(
        [
            "# batchpilot: the locally built images, imported at boot (no registry to pull from).",
            "[Unit]",
            "Description=import the control plane's images into containerd",
            "After=containerd.service",
            "Requires=containerd.service",
            "Before=kubelet.service",
            "[Service]",
            "Type=oneshot",
            "RemainAfterExit=yes",
            *steps,
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


KUBELET_DROP_IN: Final = """\
# batchpilot: the images first, and the kubelet's cgroups in every v1 hierarchy.
[Unit]
After=batchpilot-images.service
Requires=batchpilot-images.service
[Service]
ExecStartPre=/kind/bin/batchpilot-kubelet-cgroups.sh
"""

KUBELET_CGROUPS: Final = """\
#!/bin/sh
# batchpilot: on cgroup v1, the kubelet's cgroups in every hierarchy mounted now, including those
# mounted after kind's entrypoint made the others; a hierarchy the host does not mount stays an
# empty read-only directory, which the kubelet does without.
set -u
[ ! -f /sys/fs/cgroup/cgroup.controllers ] || exit 0
for hierarchy in $(findmnt -lun -o target -t cgroup | grep -v /kubelet); do
  mkdir -p "$hierarchy/kubelet" "$hierarchy/kubelet.slice" || true
done
"""

CNI_CONFIG: Final = {
    "cniVersion": "0.4.0",
    "name": "batchpilot-kind",
    "plugins": [
        {
            "type": "ptp",
            "ipMasq": False,
            "mtu": 1500,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": clusters.NODE_POD_RANGE}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        },
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}
"""kind's default CNI (kindnetd) is an image from a registry: the cluster disables it and the
node carries Debian's ptp/host-local plugins with this config instead (one node, one range)."""

STORAGE_MANIFEST: Final = """\
# batchpilot: no dynamic provisioning (local-path's image would come from a registry).
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
"""

NODE_CONTAINERFILE: Final = """\
FROM scratch
ADD rootfs.tar /
COPY overlay/ /
RUN chmod 755 /kind /kind/bin \\
    && rm -f /lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service \\
    && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \\
    && rm -f /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/basic.target.wants/* \\
    && rm -f /lib/systemd/system/sockets.target.wants/*udev* \\
    && rm -f /lib/systemd/system/sockets.target.wants/*initctl* \\
    && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \\
    && mkdir -p /etc/systemd/system.conf.d \\
    && printf '[Manager]\\nDefaultTasksMax=infinity\\n' > /etc/systemd/system.conf.d/tasks.conf \\
    && ln -sf /usr/lib/systemd/systemd /sbin/init \\
    && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \\
        batchpilot-images.service \\
    && systemctl mask systemd-binfmt.service \\
    && mkdir -p /etc/kubernetes/manifests /opt/cni \\
    && ln -s /usr/lib/cni /opt/cni/bin
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
"""
"""DefaultTasksMax=infinity: systemd gives every unit, containerd's container scopes included,
15% of the node's process limit by default; on a host whose kernel.pid_max is 32768 that was 307,
and Triton's Python backend (four instances) failed to start a thread past it ("Resource
temporarily unavailable")."""


def _copy(source: Path, target: Path, mode: int = 0o755) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source.resolve(), target)
    target.chmod(mode)


def _write_executable(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(0o755)


def stage_control_plane(context: Path, *, bins: Path) -> None:
    rootfs = context / "rootfs"
    for command in CONTROL_PLANE_COMMANDS:
        _copy(bins / command, rootfs / "usr/local/bin" / command)
    _copy(bins / "etcd", rootfs / "usr/local/bin/etcd")
    # kube-proxy's nftables mode runs `nft`: this host's, with the libraries it loads.
    if not HOST_NFT.is_file():
        raise NodeImageError(f"{HOST_NFT} is missing (Debian nftables; `make kind-deps`)")
    for path in (HOST_NFT, *shared_libraries(HOST_NFT)):
        _copy(path, rootfs / path.relative_to("/"), 0o755)
    (context / "Containerfile").write_text(CONTROL_PLANE_CONTAINERFILE)


def stage_overlay(overlay: Path, *, kind: Path, bins: Path, kubeadm: Path, pause: str) -> None:
    files = kind / "images/base/files"
    shutil.copytree(files, overlay, dirs_exist_ok=True)
    for path in overlay.rglob("*"):
        if path.is_file():
            executable = path.parent.name == "bin"
            path.chmod(0o755 if executable else 0o644)
        elif path.is_dir():
            path.chmod(0o755)
    containerd = overlay / "etc/containerd/config.toml"
    containerd.write_text(containerd_config(containerd.read_text(), pause=pause))
    (overlay / "etc/containerd/cri-base.json").write_text(cri_base_spec(bins / "ctr"))
    for command in (*building.CONTAINERD_COMMANDS, "crictl"):
        _copy(bins / command, overlay / "usr/local/bin" / command)
    for command in ("kubelet", "kubectl"):
        _copy(bins / command, overlay / "usr/bin" / command)
    _copy(kubeadm, overlay / "usr/bin/kubeadm")
    (overlay / "kind/version").write_text(versions.KUBERNETES + "\n")
    (overlay / "kind/manifests").mkdir(parents=True, exist_ok=True)
    (overlay / "kind/manifests/default-storage.yaml").write_text(STORAGE_MANIFEST)
    units = overlay / "etc/systemd/system"
    (units / "batchpilot-images.service").write_text(
        import_unit(["control-plane.tar", "pause.tar"])
    )
    (units / "kubelet.service.d/20-batchpilot.conf").write_text(KUBELET_DROP_IN)
    _write_executable(overlay / "kind/bin/batchpilot-kubelet-cgroups.sh", KUBELET_CGROUPS)
    (overlay / "etc/cni/net.d").mkdir(parents=True, exist_ok=True)
    (overlay / "etc/cni/net.d/10-batchpilot.conflist").write_text(json.dumps(CNI_CONFIG, indent=2))
    (overlay / "etc/sysctl.d/20-batchpilot-forwarding.conf").write_text(
        "# the node routes between the host and its Pods (ptp)\nnet.ipv4.ip_forward=1\n"
    )


def recipe_tag(*, kind: Path, bins: Path, kubeadm: Path, rootfs: Path, pause: str) -> str:
    """A hash of everything that goes in: the image is rebuilt only when one of them changes."""
    digest = hashlib.sha256()
    for text in (
        RECIPE_VERSION,
        KIND_VERSION,
        pause,
        rootfs.name,
        NODE_CONTAINERFILE,
        CONTROL_PLANE_CONTAINERFILE,
        KUBELET_DROP_IN,
        KUBELET_CGROUPS,
        STORAGE_MANIFEST,
        json.dumps(CNI_CONFIG),
        import_unit(["control-plane.tar", "pause.tar"]),
        json.dumps(building.read_stamps(bins), sort_keys=True),
        str(kubeadm.stat().st_size),
        Path(__file__).read_text(),
    ):
        digest.update(text.encode() + b"\0")
    for path in sorted((kind / "images/base/files").rglob("*")):
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build(*, buildah: images.Buildah | None = None) -> NodeImage:
    """The node image's archive (docker-archive, which both engines load), built if missing."""
    kind = kind_source()
    bins = building.require_binaries(NODE_BINARIES)
    kubeadm = kubeadm_binary()
    pause_archive = pauseimages.build()
    pause = pauseimages.image_name()
    rootfs = rootfs_tarball()
    tag = recipe_tag(kind=kind, bins=bins, kubeadm=kubeadm, rootfs=rootfs, pause=pause)
    reference = f"{NODE_REPOSITORY}:{tag}"
    archive = kind_root() / "node-images" / f"node-{tag}.docker.tar"
    if archive.is_file():
        return NodeImage(reference=reference, archive=archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    log = logs_dir() / "node-image.log"
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=kind_root(), prefix=".node-image-") as scratch:
        work = Path(scratch)
        storage = buildah or images.Buildah(root=work / "storage")
        planes = work / "control-plane"
        stage_control_plane(planes, bins=bins)
        planes_name = control_plane_names()[0]
        storage.run(
            "bud", "--quiet", "--tag", planes_name, str(planes), what="control plane image", log=log
        )
        context = work / "node"
        overlay = context / "overlay"
        stage_overlay(overlay, kind=kind, bins=bins, kubeadm=kubeadm, pause=pause)
        (overlay / "kind/images").mkdir(parents=True, exist_ok=True)
        storage.run(
            "push",
            "--quiet",
            planes_name,
            f"docker-archive:{overlay / 'kind/images/control-plane.tar'}:{planes_name}",
            what="control plane image",
            log=log,
        )
        shutil.copy2(pause_archive, overlay / "kind/images/pause.tar")
        shutil.copy2(rootfs, context / "rootfs.tar")
        (context / "Containerfile").write_text(NODE_CONTAINERFILE)
        storage.run(
            "bud",
            "--quiet",
            "--isolation",
            "chroot",
            "--tag",
            reference,
            str(context),
            what="kind node image",
            log=log,
            timeout=NODE_TIMEOUT_SECONDS,
        )
        staging = archive.with_name(f".staging-{archive.name}")
        storage.run(
            "push", "--quiet", reference, f"docker-archive:{staging}:{reference}",
            what="kind node image", log=log, timeout=NODE_TIMEOUT_SECONDS,
        )  # fmt: skip
        staging.rename(archive)
    for old in archive.parent.glob("node-*.docker.tar"):
        if old != archive:
            old.unlink()
    return NodeImage(reference=reference, archive=archive)
