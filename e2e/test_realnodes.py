"""The real node's configuration and cleanup rules, without starting it or touching the host."""

import dataclasses
import ipaddress
import json
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from batchpilot_cluster import (
    building,
    certificates,
    controlplane,
    pauseimages,
    podnetwork,
    processes,
    realnodes,
)

NODE = realnodes.Node(
    name="batchpilot-node-0",
    state_dir=Path("/work/checkout/.run/cluster"),
    pod_cidr=controlplane.REAL_NODE_POD_CIDR,
    kubelet_port=40001,
    kubelet_healthz_port=40002,
)
PKI = certificates.Pki(directory=NODE.state_dir / "pki")


def under_node_dir(path: str) -> bool:
    return Path(path).is_relative_to(NODE.directory)


def test_containerd_keeps_everything_under_the_node_dir_and_uses_the_local_pause_image() -> None:
    rendered = realnodes.containerd_config(
        NODE,
        shim=Path("/cache/bin/containerd-shim-runc-v2"),
        runc=Path("/usr/sbin/runc"),
        sandbox_image="localhost/batchpilot/pause:abc",
    )
    config = tomllib.loads(rendered)
    assert config["version"] == 4
    assert config["imports"] == []  # nothing from /etc/containerd
    plugins = config["plugins"]
    paths = [
        config["root"],
        config["state"],
        plugins["io.containerd.server.v1.grpc"]["address"],
        plugins["io.containerd.server.v1.ttrpc"]["address"],
    ]
    runtime = plugins["io.containerd.cri.v1.runtime"]
    runc = runtime["containerd"]["runtimes"]["runc"]
    paths += [runc["options"]["Root"], runtime["cni"]["conf_dir"]]
    assert all(under_node_dir(path) for path in paths), paths
    images = plugins["io.containerd.cri.v1.images"]
    assert images["pinned_images"]["sandbox"] == "localhost/batchpilot/pause:abc"
    assert runtime["netns_mounts_under_state_dir"] is True
    assert runtime["restrict_oom_score_adj"] is True
    assert runc["runtime_path"] == "/cache/bin/containerd-shim-runc-v2"  # not Debian's 1.6 shim
    assert runc["options"]["BinaryName"] == "/usr/sbin/runc"
    assert runc["options"]["SystemdCgroup"] is False
    assert runtime["cni"]["bin_dirs"] == [str(realnodes.CNI_BIN_DIR)]
    assert "io.containerd.nri.v1.nri" in config["disabled_plugins"]
    assert "io.containerd.internal.v1.opt" in config["disabled_plugins"]


def test_a_state_dir_too_long_for_a_unix_socket_is_refused_by_name() -> None:
    realnodes.check_paths(NODE)
    deep = realnodes.Node(name="n", state_dir=Path("/x" * 50), pod_cidr=NODE.pod_cidr)
    with pytest.raises(realnodes.NodeError, match="too long for containerd's socket"):
        realnodes.check_paths(deep)


def test_pods_bridge_without_masquerade_and_route_only_the_run_s_networks() -> None:
    config = realnodes.cni_config(NODE, routes=controlplane.HOST_ROUTES)
    (bridge,) = config["plugins"]
    assert bridge["type"] == "bridge"
    assert bridge["bridge"] == realnodes.BRIDGE
    assert bridge["ipMasq"] is False
    assert bridge["isDefaultGateway"] is False
    ipam = bridge["ipam"]
    assert ipam["ranges"] == [[{"subnet": "10.88.254.0/24", "gateway": "10.88.254.1"}]]
    assert [route["dst"] for route in ipam["routes"]] == list(controlplane.HOST_ROUTES)
    assert under_node_dir(ipam["dataDir"])


def test_the_real_node_s_network_is_apart_from_kwok_nodes_and_clients_and_filtered() -> None:
    real = ipaddress.ip_network(controlplane.REAL_NODE_POD_CIDR)
    assert real.subnet_of(controlplane.POD_NETWORK)  # type: ignore[arg-type]
    kwok = [
        ipaddress.ip_network(controlplane.node_pod_cidr(index))
        for index in range(controlplane.MAX_NODES)
    ]
    assert not any(real.overlaps(cidr) for cidr in kwok)
    assert not real.overlaps(podnetwork.CLIENT_NETWORK)
    # The bridge is one of the run's links to the forward filter.
    assert realnodes.BRIDGE.startswith(podnetwork.LINK_PREFIX)
    assert len(realnodes.BRIDGE) <= 15
    guarded = podnetwork.filter_rules(node_gateways=[NODE.gateway, "10.88.253.1"])
    assert 'ip daddr { 10.88.254.1, 10.88.253.1 } iifname != "lo" iifname != "bpe*" drop' in (
        guarded
    )
    assert "chain input" not in podnetwork.filter_rules()


def test_the_kubelet_runs_on_cgroup_v1_keeps_images_and_trusts_only_the_run_s_ca() -> None:
    config = realnodes.kubelet_config(NODE, pki=PKI)
    assert config["failCgroupV1"] is False
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["cgroupRoot"] == f"/{realnodes.CGROUP_ROOT}"
    assert config["failSwapOn"] is False
    assert config["imageGCHighThresholdPercent"] == 100
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["authentication"]["x509"]["clientCAFile"] == str(PKI.ca_cert)
    assert config["authorization"]["mode"] == "Webhook"
    assert config["readOnlyPort"] == 0
    assert config["address"] == NODE.gateway
    assert config["healthzBindAddress"] == "127.0.0.1"
    assert config["containerRuntimeEndpoint"] == f"unix://{NODE.containerd_socket}"
    for key in ("resolvConf", "podLogsDir", "volumePluginDir"):
        assert under_node_dir(config[key]), key
    assert "nameserver 127.0.0.1" in realnodes.RESOLV_CONF
    # A 24 GiB machine under load keeps more than these free; the kubelet must not evict.
    assert config["evictionHard"]["memory.available"] == "256Mi"

    argv = realnodes.kubelet_argv(NODE, kubelet=Path("/cache/bin/kubelet"))
    assert f"--root-dir={NODE.kubelet_root}" in argv
    assert f"--hostname-override={NODE.name}" in argv
    assert f"--node-ip={NODE.gateway}" in argv
    assert all(under_node_dir(arg.split("=", 1)[1]) for arg in argv if arg.endswith("dir"))


def test_the_node_is_registered_with_its_pod_cidr_and_keeps_kwok_pods_off() -> None:
    manifest = realnodes.node_manifest(NODE)
    assert manifest["spec"]["podCIDRs"] == [controlplane.REAL_NODE_POD_CIDR]
    assert manifest["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    ]
    assert controlplane.KWOK_NODE_ANNOTATION not in manifest["metadata"].get("annotations", {})
    assert NODE.identity.user == "system:node:batchpilot-node-0"
    assert NODE.identity.groups == ("system:nodes",)


def test_a_missing_runtime_or_cni_plugin_is_named_with_its_package(tmp_path: Path) -> None:
    (tmp_path / "bridge").write_text("")
    missing = realnodes.missing_tools(runc=None, cni_bin_dir=tmp_path)
    assert missing[0] == "runc (Debian package runc)"
    assert "CNI plugins host-local, loopback in" in missing[1]
    assert "containernetworking-plugins" in missing[1]


def test_only_shim_sockets_in_containerd_s_socket_dir_are_trusted(tmp_path: Path) -> None:
    tasks = tmp_path / "io.containerd.runtime.v2.task" / "k8s.io"
    ours = realnodes.SHIM_SOCKETS / ("a" * 64)
    for name, address in (("one", f"unix://{ours}"), ("two", "unix:///etc/passwd")):
        (tasks / name).mkdir(parents=True)
        (tasks / name / "bootstrap.json").write_text(
            json.dumps({"version": 3, "address": address, "protocol": "ttrpc"})
        )
    (tasks / "three").mkdir()
    (tasks / "three" / "address").write_text(f"unix://{realnodes.SHIM_SOCKETS / ('b' * 64)}\n")
    assert sorted(realnodes.shim_sockets(tmp_path)) == [
        ours,
        realnodes.SHIM_SOCKETS / ("b" * 64),
    ]


def test_log_links_and_cni_cache_entries_of_other_runs_stay(tmp_path: Path) -> None:
    pod_logs = tmp_path / "node" / "pod-logs"
    links = tmp_path / "containers"
    links.mkdir()
    (links / "ours.log").symlink_to(pod_logs / "ns_pod_uid" / "main" / "0.log")
    (links / "theirs.log").symlink_to(tmp_path / "elsewhere" / "0.log")
    assert realnodes.remove_log_links(pod_logs, links_dir=links) == [links / "ours.log"]
    assert [path.name for path in links.iterdir()] == ["theirs.log"]

    cache = tmp_path / "cni"
    cache.mkdir()
    for name in ("batchpilot-e2e-1234-eth0", "cni-loopback-1234-lo", "cni-loopback-99-lo", "x"):
        (cache / name).write_text("{}")
    removed = realnodes.remove_cni_cache("batchpilot-e2e", ["1234"], cache=cache)
    assert sorted(path.name for path in removed) == [
        "batchpilot-e2e-1234-eth0",
        "cni-loopback-1234-lo",
    ]
    assert sorted(path.name for path in cache.iterdir()) == ["cni-loopback-99-lo", "x"]


def test_containerd_is_built_cgo_free_with_its_version_and_the_kubelet_with_kubernetes() -> None:
    products = {product.name: product for product in building.products("go 1.26.0\n")}
    containerd = products["containerd"]
    assert containerd.binaries == ("containerd", "containerd-shim-runc-v2", "ctr")
    assert containerd.tags == ("no_btrfs",)
    assert any("containerd/v2/version.Version=" in flag for flag in containerd.ldflags)
    assert "kubelet" in products["kubernetes"].binaries
    assert building.newer_go("1.26.0", "1.26.6") == "1.26.6"
    assert building.newer_go("1.26.8", "1.9") == "1.26.8"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_pause_process_waits_until_sigterm_and_then_exits_cleanly(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    subprocess.run(
        ["gcc", "-static", "-Os", "-o", str(binary), str(pauseimages.SOURCE)], check=True
    )
    process = subprocess.Popen([str(binary)])
    try:
        time.sleep(0.2)
        assert process.poll() is None  # it waits
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        process.kill()
        process.wait()


def test_the_kernel_tunables_the_kubelet_changes_are_put_back(tmp_path: Path) -> None:
    proc_sys = tmp_path / "sys"
    for name in realnodes.KERNEL_TUNABLES:
        (proc_sys / name).parent.mkdir(parents=True, exist_ok=True)
        (proc_sys / name).write_text("0\n")
    node = realnodes.Node(name="n", state_dir=tmp_path, pod_cidr=NODE.pod_cidr)
    node.directory.mkdir()
    realnodes.record_host_state(node, proc_sys=proc_sys)
    (proc_sys / "kernel/panic_on_oops").write_text("1\n")  # the kubelet's setupKernelTunables
    realnodes.record_host_state(node, proc_sys=proc_sys)  # a restart after a crash: kept
    assert realnodes.restore_sysctls(node.directory, proc_sys=proc_sys) == {
        "kernel/panic_on_oops": "0"
    }
    assert (proc_sys / "kernel/panic_on_oops").read_text() == "0\n"


def test_a_component_that_exits_is_reported_with_its_last_error_line(tmp_path: Path) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text(
        'I1126 15:36:17.580982    7432 flags.go:64] FLAG: --v="1"\n'
        'E1126 15:36:17.581418    7432 run.go:72] "command failed" err="cgroup v1"\n'
        'I1126 15:36:17.581500    7432 flags.go:64] FLAG: --vmodule=""\n'
    )
    assert controlplane.last_error(log) == (
        'E1126 15:36:17.581418    7432 run.go:72] "command failed" err="cgroup v1"'
    )
    log.write_text('time="..." level=fatal msg="failed to load config"\n')
    assert controlplane.last_error(log) == 'time="..." level=fatal msg="failed to load config"'
    log.write_text("all is well\n")
    assert controlplane.last_error(log) is None


def test_a_cluster_starting_elsewhere_is_seen_by_its_processes_owner_mark(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    env = {"PATH": "/usr/bin:/bin", processes.OWNER_ENV: str(theirs)}
    process = subprocess.Popen(["sleep", "30"], env=env)
    try:
        deadline = time.monotonic() + 5
        while str(theirs) not in processes.other_owners(ours) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(theirs) in processes.other_owners(ours)
        assert str(theirs) not in processes.other_owners(theirs)
    finally:
        process.kill()
        process.wait()
    assert str(theirs) not in processes.other_owners(ours)


def test_the_node_s_cpu_weight_is_a_process_s_for_each_core() -> None:
    assert realnodes.node_cpu_shares(2) == 2048
    assert realnodes.node_cpu_shares(1) == 1024


def test_every_further_real_node_has_names_paths_and_a_pod_cidr_of_its_own() -> None:
    state_dir = NODE.state_dir
    first, second = (
        realnodes.nth(index, state_dir=state_dir, pod_cidr=controlplane.real_node_pod_cidr(index))
        for index in range(2)
    )
    # Node 0 keeps the names a one-node run always had.
    assert (first.name, first.bridge, first.cgroup_root) == (
        realnodes.NAME,
        realnodes.BRIDGE,
        realnodes.CGROUP_ROOT,
    )
    assert first.directory == state_dir / "node"
    assert first.is_first
    assert first.component("kubelet") == "kubelet"
    assert (second.name, second.bridge, second.cgroup_root, second.network_name) == (
        "batchpilot-node-1",
        "bpenode1",
        "batchpilot-e2e-1",
        "batchpilot-e2e-1",
    )
    assert second.directory == state_dir / "node-1"
    assert not second.is_first
    assert second.component("containerd") == "containerd-node-1"
    assert second.label_value == "real-1"
    assert second.pod_cidr == "10.88.253.0/24"
    assert second.gateway == "10.88.253.1"
    with pytest.raises(realnodes.NodeError, match="nodes 0 to 3"):
        realnodes.nth(realnodes.MAX_REAL_NODES, state_dir=state_dir, pod_cidr="10.88.250.0/24")

    every = [
        realnodes.nth(i, state_dir=state_dir, pod_cidr=controlplane.real_node_pod_cidr(i))
        for i in range(realnodes.MAX_REAL_NODES)
    ]
    cidrs = [ipaddress.ip_network(node.pod_cidr) for node in every]
    kwok = [
        ipaddress.ip_network(controlplane.node_pod_cidr(index))
        for index in range(controlplane.MAX_NODES)
    ]
    for index, cidr in enumerate(cidrs):
        assert not any(cidr.overlaps(other) for other in cidrs[index + 1 :] + kwok)
        assert not cidr.overlaps(podnetwork.CLIENT_NETWORK)
    for node in every:
        assert node.bridge.startswith(podnetwork.LINK_PREFIX)
        assert len(node.bridge) <= 15
        realnodes.check_paths(node)
    # Their kubelets serve with certificates of their own names and run in cgroups apart.
    config = realnodes.kubelet_config(second, pki=PKI)
    assert config["tlsCertFile"] == str(PKI.kubelet_serving_cert("batchpilot-node-1"))
    assert config["tlsCertFile"] != realnodes.kubelet_config(first, pki=PKI)["tlsCertFile"]
    assert config["cgroupRoot"] == "/batchpilot-e2e-1"
    assert config["address"] == "10.88.253.1"
    assert realnodes.cni_config(second, routes=controlplane.HOST_ROUTES)["name"] == (
        "batchpilot-e2e-1"
    )
    manifest = realnodes.node_manifest(second)
    assert manifest["metadata"]["labels"][realnodes.NODE_LABEL[0]] == "real-1"
    assert manifest["spec"]["taints"] == realnodes.node_manifest(first)["spec"]["taints"]


def test_a_cluster_with_two_real_nodes_is_saved_and_loaded_and_stops_kubelets_first(
    tmp_path: Path,
) -> None:
    ports, extra = controlplane.pick_ports(extra_nodes=1)
    assert len(extra) == 1
    assert len({*dataclasses.astuple(ports), *extra[0]}) == len(dataclasses.astuple(ports)) + 2
    cluster = controlplane.Cluster(
        state_dir=tmp_path,
        kubernetes_version="v1.36.3",
        ports=ports,
        nodes=("kwok-node-0",),
        pod_cidrs=("10.88.0.0/24",),
        extra_node_ports=extra,
    )
    (tmp_path / controlplane.STATE_FILE).write_text(cluster.to_json())
    loaded = controlplane.Cluster.load(tmp_path)
    assert loaded == cluster
    assert [node.name for node in loaded.real_nodes] == ["batchpilot-node-0", "batchpilot-node-1"]
    assert loaded.node == loaded.real_nodes[0]
    assert loaded.real_nodes[1].kubelet_healthz_port == extra[0][1]
    assert loaded.api_address == "10.88.254.1"
    # A state file written before there were further nodes loads as one real node.
    older = json.loads(cluster.to_json())
    del older["extra_node_ports"]
    (tmp_path / controlplane.STATE_FILE).write_text(json.dumps(older))
    assert len(controlplane.Cluster.load(tmp_path).real_nodes) == 1

    pids = tmp_path / "pids"
    pids.mkdir()
    for name in ("etcd", "kubelet", "containerd", "kubelet-node-1", "containerd-node-1"):
        (pids / f"{name}.pid").write_text("1\n")
    order = controlplane.stop_order(tmp_path)
    assert order[:4] == ("kubelet-node-1", "kubelet", "containerd-node-1", "containerd")
    assert order[-1] == "podnetwork-lock"
    assert set(order) >= set(controlplane.COMPONENTS)
