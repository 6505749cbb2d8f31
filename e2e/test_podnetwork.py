"""The pod network's names and rules, without touching the host's network."""

import ipaddress

from batchpilot_cluster import controlplane, podnetwork


def test_a_host_is_named_after_its_ip_within_linux_limits() -> None:
    host = podnetwork.Host(ip="10.88.254.253")
    assert host.netns == "bpe2e-10-88-254-253"
    assert host.link == "bpe0a58fefd"
    assert len(host.link) <= 15  # IFNAMSIZ - 1
    assert host.exec_argv(["python3", "-V"]) == [
        "ip", "netns", "exec", "bpe2e-10-88-254-253", "python3", "-V",
    ]  # fmt: skip


def test_clients_are_in_the_pod_network_but_in_no_node_s_pod_cidr() -> None:
    assert podnetwork.CLIENT_NETWORK.subnet_of(controlplane.POD_NETWORK)  # type: ignore[arg-type]
    node_cidrs = [
        ipaddress.ip_network(controlplane.node_pod_cidr(index))
        for index in range(controlplane.MAX_NODES)
    ]
    assert not any(podnetwork.CLIENT_NETWORK.overlaps(cidr) for cidr in node_cidrs)


def test_the_gateway_is_link_local_and_outside_what_namespaces_route() -> None:
    assert not any(
        ipaddress.ip_address(podnetwork.GATEWAY) in ipaddress.ip_network(network)
        for network in controlplane.HOST_ROUTES
    )
    assert ipaddress.ip_address(podnetwork.GATEWAY).is_link_local


def test_the_filter_drops_whatever_would_leave_the_run_s_veths() -> None:
    rules = podnetwork.filter_rules()
    assert 'iifname "bpe*" oifname != "bpe*" drop' in rules
    assert 'oifname "bpe*" iifname != "bpe*" drop' in rules
    assert rules.count("delete table inet batchpilot-e2e") == 1  # replaced whole, atomically
