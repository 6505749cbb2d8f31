"""Drain timing on the real node: how soon a Pod whose readiness gate goes False stops getting new
connections through its Service, which the drain's `rollout.settleSeconds` (default 1.5 s) rests
on; and how long a Triton + sidecar Pod takes from creation to Ready.

On the local cluster (`batchpilot_cluster`), two web Pods (`batchpilot_testbed.webpods`) with
batchpilot's readiness
gate run on the real node (its kubelet, containerd, CNI) behind a ClusterIP Service. Each round
opens both gates, waits until kube-proxy routes to both, then closes one gate, as the operator
does before a reload, and from that moment polls, each in its own thread every 20 ms:

- the Pod's `Ready` condition, which the kubelet computes from its containers and the gate;
- the Service's EndpointSlice, which kube-controller-manager writes from `Ready`;
- kube-proxy's nftables rules (`nft list table ip kube-proxy`): the Pod's address gone from the
  Service chain's DNAT map, after which no new connection is sent to it;

then asks through the Service, from a client network namespace, for 20 new connections: none
may reach the drained Pod. Then it starts Triton + sidecar Pods (`batchpilot_testbed.fleet`, this
checkout's
images, without the gate) and times each from creation to Running and to Ready (the kubelet's
readiness probe on Triton's `/v2/health/ready` passing).

    python tests/benchmarks/bench_drain.py           # 20 rounds, 3 Triton Pods
    python tests/benchmarks/bench_drain.py --short   # CI: 3 rounds, 1 Triton Pod
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import benchmarking
from kubernetes import client

from batchpilot.kube import pods
from batchpilot_cluster import building, controlplane, podnetwork, realnodes
from batchpilot_testbed import clients, fleet, nodeimages, waiting, webpods
from batchpilot_testbed.kubes import Kube

POLL_SECONDS = 0.02
GIVE_UP_SECONDS = 20.0
SERVICE = "web"
WEB_PODS = ("web-0", "web-1")
DRAINED = WEB_PODS[0]
SIGNALS = ("kubelet Ready False", "out of the EndpointSlice", "out of kube-proxy's rules")


@dataclasses.dataclass(frozen=True)
class Round:
    seconds: dict[str, float | None]
    """Seconds from the gate's patch to each signal (None: not within GIVE_UP_SECONDS)."""
    reached_drained: int
    """Of the new connections through the Service afterwards, those the drained Pod answered."""


@dataclasses.dataclass(frozen=True)
class PodStart:
    running: float
    ready: float


def set_gate(kube: Kube, namespace: str, pod: str, status: str) -> None:
    body = {"status": {"conditions": [{"type": pods.GATE, "status": status}]}}
    kube.core.patch_namespaced_pod_status(pod, namespace, body)


def pod_ip(kube: Kube, namespace: str, pod: str) -> str:
    status = kube.core.read_namespaced_pod(pod, namespace).status
    assert status is not None
    assert status.pod_ip
    return str(status.pod_ip)


def service_chain(namespace: str, service: str) -> str:
    """The rules of kube-proxy's chain for the Service's port `http` ("" if it has none)."""
    listed = subprocess.run(["nft", "list", "table", "ip", "kube-proxy"], capture_output=True,
                            text=True, timeout=10, check=True).stdout  # fmt: skip
    lines = listed.splitlines()
    marker = f"-{namespace}/{service}/tcp/http {{"
    for index, line in enumerate(lines):
        if line.strip().startswith("chain service-") and line.rstrip().endswith(marker):
            end = next(i for i in range(index, len(lines)) if lines[i].strip() == "}")
            return "\n".join(lines[index:end])
    return ""


def routed_by_kube_proxy(namespace: str, ip: str) -> bool:
    """Whether the Service's chain sends new connections to `ip` (`dnat ... map { 0 : ip . port }`,
    kube-proxy 1.36's nftables mode)."""
    return f" {ip} . " in service_chain(namespace, SERVICE)


def first_time(
    check: Callable[[], bool], start: float, found: dict[str, float | None], key: str
) -> None:
    """Poll `check` until it holds; record the seconds since `start` under `key`."""
    while time.monotonic() - start < GIVE_UP_SECONDS:
        try:
            if check():
                found[key] = time.monotonic() - start
                return
        except (client.ApiException, OSError, subprocess.SubprocessError):
            pass
        time.sleep(POLL_SECONDS)
    found[key] = None


def one_round(
    kube: Kube, namespace: str, client_host: podnetwork.Host, ips: dict[str, str]
) -> Round:
    for pod in WEB_PODS:
        set_gate(kube, namespace, pod, "True")
    waiting.wait_for(
        "kube-proxy routing to both Pods",
        lambda: all(routed_by_kube_proxy(namespace, ip) for ip in ips.values()),
        timeout=30,
        interval=0.1,
    )
    time.sleep(0.5)
    drained_ip = ips[DRAINED]
    checks: dict[str, Callable[[], bool]] = {
        SIGNALS[0]: lambda: fleet.pod_condition(kube, namespace, DRAINED, "Ready") == "False",
        SIGNALS[1]: lambda: drained_ip not in fleet.ready_endpoints(kube, namespace, SERVICE),
        SIGNALS[2]: lambda: not routed_by_kube_proxy(namespace, drained_ip),
    }
    found: dict[str, float | None] = {}
    start = time.monotonic()
    set_gate(kube, namespace, DRAINED, "False")
    threads = [
        threading.Thread(target=first_time, args=(check, start, found, key))
        for key, check in checks.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers = clients.probe(client_host, f"http://{service_ip(kube, namespace)}/", count=20)
    return Round(seconds=found, reached_drained=answers.get(DRAINED, 0))


def service_ip(kube: Kube, namespace: str) -> str:
    spec = kube.core.read_namespaced_service(SERVICE, namespace).spec
    assert spec is not None
    return str(spec.cluster_ip)


def start_web_pods(kube: Kube, namespace: str) -> dict[str, str]:
    assert kube.local is not None
    image = nodeimages.python_image()
    realnodes.import_image(
        kube.local.node, ctr=building.require_binaries() / "ctr", archive=image.archive
    )
    for pod in WEB_PODS:
        kube.core.create_namespaced_pod(
            namespace, webpods.web_pod(pod, image.reference, gates=(pods.GATE,))
        )
    webpods.create_service(kube, namespace, SERVICE)

    def serving() -> bool:
        return all(
            fleet.pod_condition(kube, namespace, pod, "ContainersReady") == "True"
            for pod in WEB_PODS
        )

    waiting.wait_for("the web Pods serving", serving, timeout=120)
    return {pod: pod_ip(kube, namespace, pod) for pod in WEB_PODS}


def time_triton_starts(kube: Kube, namespace: str, count: int) -> list[PodStart]:
    placement = fleet.placement(kube)
    created: dict[str, float] = {}
    for index in range(count):
        name = f"triton-{index}"
        created[name] = time.monotonic()
        kube.core.create_namespaced_pod(
            namespace,
            fleet.triton_pod(name, placement=placement, labels={"app": "triton"}, gated=False),
        )
    running: dict[str, float] = {}
    ready: dict[str, float] = {}

    def all_ready() -> bool:
        for name in created:
            status = kube.core.read_namespaced_pod(name, namespace).status
            now = time.monotonic()
            if status and status.phase == "Running":
                running.setdefault(name, now - created[name])
            if fleet.pod_condition(kube, namespace, name, "Ready") == "True":
                ready.setdefault(name, now - created[name])
        return len(ready) == len(created)

    waiting.wait_for(f"{count} Triton Pods Ready", all_ready, timeout=180, interval=0.1)
    return [PodStart(running=running[name], ready=ready[name]) for name in created]


def _spread(values: Sequence[float | None]) -> str:
    known = sorted(value for value in values if value is not None)
    if not known:
        return "-"
    missed = len(values) - len(known)
    text = f"{statistics.median(known):.2f} ({known[0]:.2f}-{known[-1]:.2f})"
    return text + (f", {missed} not within {GIVE_UP_SECONDS:.0f} s" if missed else "")


def render(rounds: Sequence[Round], starts: Sequence[PodStart], *, markdown: bool) -> str:
    tabulate = benchmarking.markdown_table if markdown else benchmarking.table
    rows = [[signal, _spread([r.seconds.get(signal) for r in rounds])] for signal in SIGNALS]
    reached = sum(r.reached_drained for r in rounds)
    start_rows = [
        ["created -> Running", _spread([s.running for s in starts])],
        ["created -> Ready (Triton's readiness probe)", _spread([s.ready for s in starts])],
    ]
    return "\n".join(
        [
            f"gate False -> (seconds, median (min-max) of {len(rounds)} rounds, polled every "
            f"{POLL_SECONDS * 1000:.0f} ms):",
            tabulate(["signal", "seconds"], rows),
            "",
            f"new connections through the Service after kube-proxy's rules dropped it: "
            f"{reached} of {20 * len(rounds)} reached the drained Pod",
            "",
            f"Triton + sidecar Pods on the real node ({len(starts)}):",
            tabulate(["step", "seconds"], start_rows),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--short", action="store_true", help="3 rounds, 1 Triton Pod")
    benchmarking.output_arguments(parser)
    arguments = parser.parse_args(argv)
    rounds_wanted, tritons = (3, 1) if arguments.short else (20, 3)
    out_dir: Path = arguments.out
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"drain timing on the real node: {rounds_wanted} rounds, {tritons} Triton Pod(s)",
        flush=True,
    )
    with (
        benchmarking.local_cluster() as kube,
        podnetwork.client_host(routes=controlplane.HOST_ROUTES) as client_host,
    ):
        with benchmarking.namespace(kube, "bench-drain") as namespace:
            ips = start_web_pods(kube, namespace)
            rounds = [one_round(kube, namespace, client_host, ips) for _ in range(rounds_wanted)]
        with benchmarking.namespace(kube, "bench-drain-start") as namespace:
            starts = time_triton_starts(kube, namespace, tritons)
    data = {
        "rounds": [dataclasses.asdict(r) for r in rounds],
        "starts": [dataclasses.asdict(s) for s in starts],
    }
    benchmarking.write_summary(
        out_dir, "summary-drain", tables=functools.partial(render, rounds, starts), data=data
    )
    if arguments.publish:
        benchmarking.publish(out_dir, ["summary-drain.md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
