"""The kind path's pure parts: the cluster config, the node image's files, the engine's choice
and its network (`make e2e-kind` itself runs them against Podman or Docker)."""

import ipaddress
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from batchpilot_cluster import controlplane
from batchpilot_testbed.kind import __main__ as kind_main
from batchpilot_testbed.kind import clusters, engines, nodeimages

pytestmark = pytest.mark.timeout(30)

KIND_CONTAINERD = """\
[plugins."io.containerd.grpc.v1.cri"]
  # use fixed sandbox image
  sandbox_image = "registry.k8s.io/pause:3.10"
  restrict_oom_score_adj = false
"""


def test_the_cluster_networks_collide_with_none_of_the_local_clusters_or_the_engines() -> None:
    ours = [
        ipaddress.ip_network(network) for network in (*clusters.NETWORKS, engines.NETWORK_SUBNET)
    ]
    taken = [
        ipaddress.ip_network(network)
        for network in (*controlplane.HOST_ROUTES, "10.88.0.0/16", "172.17.0.0/16")
    ]
    for network in ours:
        assert not any(network.overlaps(other) for other in taken), network
    assert ipaddress.ip_network(clusters.NODE_POD_RANGE).subnet_of(
        ipaddress.ip_network(clusters.POD_SUBNET)
    )


def test_a_node_built_here_gets_its_image_repository_cni_and_cgroup_v1_kubelet() -> None:
    config = kind_main.cluster_config(local_node=True)
    networking = config["networking"]
    assert networking["podSubnet"] == clusters.POD_SUBNET
    assert networking["serviceSubnet"] == clusters.SERVICE_SUBNET
    assert networking["disableDefaultCNI"] is True
    patches = [yaml.safe_load(patch) for patch in config["kubeadmConfigPatches"]]
    cluster = next(patch for patch in patches if patch["kind"] == "ClusterConfiguration")
    assert cluster["imageRepository"] == nodeimages.IMAGE_REPOSITORY
    assert cluster["etcd"]["local"]["imageTag"] == nodeimages.ETCD_TAG
    kubelet = next(patch for patch in patches if patch["kind"] == "KubeletConfiguration")
    assert kubelet["failCgroupV1"] is False
    (mount,) = config["nodes"][0]["extraMounts"]
    assert mount == {
        "hostPath": str(clusters.MODEL_REPOSITORY),
        "containerPath": clusters.MODEL_PATH,
        "readOnly": True,
    }


def test_a_registry_node_image_keeps_kinds_own_repository_and_cni() -> None:
    config = kind_main.cluster_config(local_node=False)
    assert "kubeadmConfigPatches" not in config
    assert "disableDefaultCNI" not in config["networking"]
    assert config["networking"]["serviceSubnet"] == clusters.SERVICE_SUBNET


def test_containerd_config_takes_the_local_pause_image_and_restricts_oom_score_adj() -> None:
    config = nodeimages.containerd_config(KIND_CONTAINERD, pause="localhost/batchpilot/pause:1")
    assert 'sandbox_image = "localhost/batchpilot/pause:1"' in config
    assert "restrict_oom_score_adj = true" in config
    assert "registry.k8s.io" not in config


def test_a_containerd_config_of_another_shape_is_refused() -> None:
    with pytest.raises(nodeimages.NodeImageError, match="changed shape"):
        nodeimages.containerd_config("version = 2\n", pause="localhost/batchpilot/pause:1")


def test_the_import_unit_imports_every_archive_and_tags_every_name_kubeadm_asks_for() -> None:
    unit = nodeimages.import_unit(["control-plane.tar", "pause.tar"])
    assert "Before=kubelet.service" in unit
    assert unit.count("images import") == 2
    names = nodeimages.control_plane_names()
    for name in names[1:]:
        assert f"images tag --force {names[0]} {name}" in unit
    assert all(name.startswith(f"{nodeimages.IMAGE_REPOSITORY}/") for name in names)


def test_the_pod_network_config_allocates_from_the_nodes_range() -> None:
    (ptp, _) = nodeimages.CNI_CONFIG["plugins"]  # type: ignore[misc]
    assert ptp["ipam"]["ranges"] == [[{"subnet": clusters.NODE_POD_RANGE}]]


@pytest.mark.parametrize(
    ("inspected", "subnets"),
    [
        ([{"IPAM": {"Config": [{"Subnet": "172.29.44.0/24"}]}}], ["172.29.44.0/24"]),
        (
            [{"subnets": [{"subnet": "172.29.44.0/24", "gateway": "172.29.44.1"}]}],
            ["172.29.44.0/24"],
        ),
        (
            [{"plugins": [{"type": "bridge", "ipam": {"ranges": [[{"subnet": "10.89.0.0/24"}]]}}]}],
            ["10.89.0.0/24"],
        ),
    ],
)
def test_network_subnets_are_read_from_docker_and_both_podman_backends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, inspected: object, subnets: list[str]
) -> None:
    engine = engines.Engine(name="podman", state=tmp_path)
    monkeypatch.setattr(
        engines.Engine, "run", lambda self, *arguments, capture=True: json.dumps(inspected)
    )
    assert engine.network_subnets() == subnets


def test_without_a_docker_engine_podman_is_chosen_and_gets_its_limits_and_network(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(engines.shutil, "which", lambda name: f"/usr/bin/{name}")
    refused = subprocess.CompletedProcess(["docker", "info"], 1, "", "Cannot connect")
    monkeypatch.setattr(engines.subprocess, "run", lambda *args, **kwargs: refused)
    monkeypatch.setattr(engines.os, "geteuid", lambda: 0)
    engine = engines.detect(tmp_path)
    assert engine.name == "podman"
    environment = engine.environment()
    assert environment["KIND_EXPERIMENTAL_PROVIDER"] == "podman"
    assert environment["KIND_EXPERIMENTAL_PODMAN_NETWORK"] == engines.NETWORK
    assert environment["CONTAINERS_CONF"] == str(tmp_path / "containers.conf")


def test_with_neither_engine_the_error_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(engines.shutil, "which", lambda name: None)
    with pytest.raises(engines.EngineError, match="no docker command; no podman command"):
        engines.detect(tmp_path)


@pytest.mark.parametrize(
    ("clusters_listed", "running", "deleted"),
    [
        ("batchpilot\n", "true\n", False),
        ("batchpilot\n", "false\n", True),
        ("No kind clusters found.\n", "", False),
    ],
)
def test_a_cluster_whose_node_is_stopped_is_deleted_before_up_makes_one(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    clusters_listed: str,
    running: str,
    deleted: bool,
) -> None:
    # CI's machine starts from a snapshot: a node container left running there exists, stopped,
    # and `kind export kubeconfig` failed on it ("cannot exec in a stopped container").
    commands: list[list[str]] = []

    def kind_run(argv: list[str], **_: object) -> str:
        commands.append(list(argv))
        return clusters_listed if argv[1:] == ["get", "clusters"] else ""

    inspected = subprocess.CompletedProcess([], 0 if running else 125, running, "")
    monkeypatch.setattr(kind_main, "run", kind_run)
    monkeypatch.setattr(engines.subprocess, "run", lambda *args, **kwargs: inspected)
    engine = engines.Engine(name="podman", state=tmp_path)
    assert kind_main.remove_if_stopped(Path("/bin/kind"), engine) is deleted
    assert (["/bin/kind", "delete", "cluster", "--name", "batchpilot"] in commands) is deleted
