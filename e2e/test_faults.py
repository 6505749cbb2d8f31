"""The fleet stays correct whatever breaks: faults injected into a real cluster under load.

Each test runs load while something fails (a Pod's network, a Triton mid-reload, a sidecar, the
policy itself, the operator) and checks what must hold afterwards: every target on the decided
profile, every gate True, the status truthful, and no failed request outside the faulted Pod.
"""

import contextlib
import datetime
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchpilot_cluster import controlplane, podnetwork, podsandboxes
from batchpilot_harness import loadgen, local_prometheus
from batchpilot_testbed import clients, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess
from batchpilot_triton import endpoints

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_cluster")]

StartOperator = Callable[..., OperatorProcess]

ONE_AT_A_TIME: dict[str, Any] = {"rollout": {"maxUnavailable": 1, "drainTimeoutSeconds": 10}}
SETTLE = ["--settle-seconds", "2"]
"""Slower switches than the default, so that a fault lands in the middle of a rollout."""
INTERACTIVE = {"profile": "interactive"}


def failures(records: list[loadgen.RequestRecord]) -> list[str]:
    return [str(record.error or record.status) for record in records if not record.succeeded]


def target_states(kube: Kube, namespace: str) -> dict[str, str]:
    status = operators.policy_status(kube, namespace, "fleet")
    return {target["name"]: target["state"] for target in status.get("targetDetails") or []}


def container_restarts(kube: Kube, namespace: str, pod: str) -> list[int]:
    status = kube.core.read_namespaced_pod(pod, namespace).status
    return [c.restart_count for c in (status.container_statuses if status else None) or []]


def some_switched(ips: dict[str, str], profile: str) -> Callable[[], bool]:
    """Part of the fleet, not all of it, serves `profile`: a rollout half way."""

    def check() -> bool:
        switched = sum(fleet.served_profile(ip) == profile for ip in ips.values())
        return 1 <= switched < len(ips)

    return check


def behind_a_service(
    kube: Kube, namespace: str, ips: dict[str, str], client_host: podnetwork.Host
) -> str:
    """A Service over the fleet, every Pod in its endpoints and kube-proxy routing it; its IP."""
    service_ip = fleet.create_service(kube, namespace, selector={"app": "triton"})
    waiting.wait_for(
        "every Pod behind the Service",
        lambda: fleet.ready_endpoints(kube, namespace, "triton") == set(ips.values()),
        timeout=20,
    )
    ready_url = f"http://{service_ip}:{endpoints.TRITON_HTTP_PORT}/v2/health/ready"
    waiting.wait_for(
        "kube-proxy routing the Service",
        lambda: (
            not any(
                answer.startswith("error")
                for answer in clients.probe(client_host, ready_url, count=4)
            )
        ),
        timeout=30,
    )
    return service_ip


def start_fleet(
    kube: Kube, namespace: str, start_operator: StartOperator, count: int
) -> dict[str, str]:
    """`count` gated Triton Pods on bulk, switched one at a time by an operator that takes its
    time over each."""
    ips = fleet.start_tritons(kube, namespace, count, gated=True)
    start_operator(interval=2.0, extra=SETTLE)
    operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME))
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    return ips


@pytest.mark.timeout(300)
def test_a_pod_cut_off_mid_rollout_holds_up_nothing_is_reported_and_is_switched_once_back(
    kube: Kube, namespace: str, start_operator: StartOperator, client_host: podnetwork.Host
) -> None:
    ips = start_fleet(kube, namespace, start_operator, 3)
    victim = "triton-2"
    others = {pod: ip for pod, ip in ips.items() if pod != victim}
    with clients.load_on_each(client_host, ips, rate=20) as loads:
        operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME, override=INTERACTIVE))
        waiting.wait_for(
            "the first Pod switched",
            lambda: fleet.served_profile(ips["triton-0"]) == "interactive",
            timeout=40,
            interval=0.05,
        )
        link = podsandboxes.cut(ips[victim])
        cut_at = time.monotonic()
        try:
            waiting.wait_for(
                "the Pods still connected on interactive",
                fleet.everyone_serves(others, "interactive"),
                timeout=60,
            )

            def reported() -> bool:
                warned = operators.events(kube, namespace, "TargetUnreachable")
                named = any(f"pod {victim}:" in message for message in warned)
                return named and target_states(kube, namespace).get(victim) == "Unreachable"

            waiting.wait_for(f"{victim} reported unreachable", reported, timeout=60)
            reported_after = time.monotonic() - cut_at
            states = target_states(kube, namespace)
        finally:
            podsandboxes.restore(link)
        restored_at = time.monotonic()
        waiting.wait_for(
            f"{victim} on interactive once back",
            fleet.everyone_serves(ips, "interactive"),
            timeout=120,
        )
        back_after = time.monotonic() - restored_at
        waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    failed = {pod: failures(loads.records[pod]) for pod in ips}
    print(
        f"\ncut: reported after {reported_after:.1f} s, states {states}; switched "
        f"{back_after:.1f} s after the link came back; failed requests "
        f"{ {pod: len(f) for pod, f in failed.items()} } of "
        f"{ {pod: len(r) for pod, r in loads.records.items()} }"
    )
    assert states == {"triton-0": "Updated", "triton-1": "Updated", victim: "Unreachable"}
    for pod in others:
        assert failed[pod] == [], f"{pod}: {failed[pod][:3]}"
    waiting.wait_for(
        "status Ready",
        lambda: (
            operators.condition(operators.policy_status(kube, namespace, "fleet"), "Ready").get(
                "status"
            )
            == "True"
        ),
        timeout=30,
    )


@pytest.mark.timeout(300)
def test_triton_killed_in_the_middle_of_a_reload_comes_back_on_the_decided_profile(
    kube: Kube,
    namespace: str,
    start_operator: StartOperator,
    client_host: podnetwork.Host,
) -> None:
    """Through a Service: the killed Pod was out of it, and the other stays in it until the
    killed one is back, so no client request fails."""
    ips = start_fleet(kube, namespace, start_operator, 2)
    service_ip = behind_a_service(kube, namespace, ips, client_host)
    victim = "triton-0"

    def loads_seen() -> int:
        return fleet.pod_log(kube, namespace, victim, "triton").count("loading: gpu_sim")

    loads_before = loads_seen()
    load = clients.ClientProcess(
        client_host,
        style="new-connection",
        address=f"{service_ip}:{endpoints.TRITON_HTTP_PORT}",
        rate=60,
        seed=3,
    )
    with load, fleet.readiness_watched(kube, namespace, "app=triton") as readiness:
        load.start()
        time.sleep(2)
        operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME, override=INTERACTIVE))
        waiting.wait_for(
            f"a reload begun on {victim}",
            lambda: loads_seen() > loads_before,
            timeout=40,
            interval=0.02,
        )
        watch = fleet.ReadyAfterRestart(kube, namespace, victim, ips[victim], decided="interactive")
        os.kill(fleet.process_in_pod(ips[victim], "tritonserver"), signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            waiting.wait_for(
                "interactive everywhere", fleet.everyone_serves(ips, "interactive"), timeout=150
            )
            back_after = time.monotonic() - killed_at
            waiting.wait_for(
                "every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30
            )
            waiting.wait_for(
                "both Pods behind the Service again",
                lambda: fleet.ready_endpoints(kube, namespace, "triton") == set(ips.values()),
                timeout=30,
            )
            time.sleep(2)
        finally:
            watch.stop()
        records = load.stop()
    failed = failures(records)
    reasons = operators.events(kube, namespace, "ContainerRestarted")
    print(
        f"\nTriton killed mid-reload: every Pod interactive {back_after:.1f} s later; "
        f"{len(records)} requests through the Service, {len(failed)} failed; Ready after the "
        f"restart in {watch.ready_samples} samples, on another profile in {len(watch.wrong)}; "
        f"events {reasons}"
    )
    assert len(records) > 500
    assert failed == [], failed[:5]
    # triton-1's gate closed only once the restarted triton-0 was Ready again: always one Pod
    # Ready and staying (cold3, before the rollout waited for that: 2 requests refused at the
    # Service's address).
    assert readiness.fewest_serving() == 1, readiness.snapshots
    # The kubelet restarted the container, and the Pod was Ready again only on the decided
    # profile: the operator closed its gate before Triton's probe passed.
    assert watch.restarted
    assert watch.ready_samples > 0
    assert watch.wrong == []


@pytest.mark.timeout(300)
def test_a_policy_edited_mid_rollout_converges_on_its_newest_spec(
    kube: Kube, namespace: str, start_operator: StartOperator
) -> None:
    ips = start_fleet(kube, namespace, start_operator, 3)
    operators.apply_policy(
        kube, namespace, fleet.policy(**ONE_AT_A_TIME, defaultProfile="interactive")
    )
    waiting.wait_for("the rollout half way", some_switched(ips, "interactive"), timeout=40)
    # An override back to bulk while interactive rolls out: bulk must win everywhere.
    override = {"profile": "bulk", "reason": "desk closed early"}
    operators.apply_policy(
        kube,
        namespace,
        fleet.policy(**ONE_AT_A_TIME, defaultProfile="interactive", override=override),
    )
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=90)
    waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)

    def settled() -> dict[str, Any] | None:
        status = operators.policy_status(kube, namespace, "fleet")
        done = status.get("activeProfile") == "bulk" and status["targets"]["updated"] == 3
        return status if done else None

    status = waiting.wait_for("the status on bulk, 3/3", settled, timeout=30)
    assert status["reason"].endswith("desk closed early")
    assert set(target_states(kube, namespace).values()) == {"Updated"}


@pytest.mark.timeout(240)
def test_a_policy_deleted_mid_rollout_leaves_no_pod_out_of_its_services(
    kube: Kube, namespace: str, start_operator: StartOperator
) -> None:
    ips = fleet.start_tritons(kube, namespace, 3, gated=True)
    start_operator(interval=2.0, extra=SETTLE)
    operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME))
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME, override=INTERACTIVE))
    waiting.wait_for(
        "a Pod out of its Services",
        lambda: not fleet.all_gates_open(kube, namespace, ips)(),
        timeout=40,
        interval=0.05,
    )
    deleted = kube.kubectl_run("delete", "bp", "fleet", "-n", namespace, "--timeout=30s")
    assert deleted.returncode == 0, deleted.stderr
    waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    # Nothing switches them any more: what each serves stays as it was.
    served = {pod: fleet.served_profile(ip) for pod, ip in ips.items()}
    time.sleep(5)
    assert {pod: fleet.served_profile(ip) for pod, ip in ips.items()} == served
    assert fleet.all_gates_open(kube, namespace, ips)()


@contextlib.contextmanager
def signal_source(
    source: str, namespace: str, pod: str, ip: str, directory: Path
) -> Iterator[tuple[dict[str, Any], Callable[[], None], Callable[[], None]]]:
    """The policy's `load` fields for `source`, and how to silence it and bring it back: a
    sidecar hung (SIGSTOP: alive, silent), or a real Prometheus scraping the Pod's Triton and
    sidecar (with the labels Kubernetes service discovery gives) stopped and started again."""
    if source == "sidecar":
        sidecar = fleet.process_in_pod(ip, "batchpilot_sidecar")
        try:
            yield (
                {"source": "sidecar"},
                lambda: os.kill(sidecar, signal.SIGSTOP),
                lambda: os.kill(sidecar, signal.SIGCONT),
            )
        finally:
            os.kill(sidecar, signal.SIGCONT)  # a second SIGCONT changes nothing
        return
    labels = {"namespace": namespace, "pod": pod}
    ports = (endpoints.TRITON_METRICS_PORT, endpoints.SIDECAR_PORT)
    server = local_prometheus.PrometheusServer(
        directory / "prometheus",
        [local_prometheus.ScrapeTarget(f"{ip}:{port}", labels) for port in ports],
    )
    server.start()
    try:
        yield {"source": "prometheus", "prometheus": {"url": server.url}}, server.stop, server.start
    finally:
        server.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["sidecar", "prometheus"])
def test_a_silent_signal_source_hands_the_decision_back_after_the_grace_period_and_takes_it_again(
    kube: Kube,
    namespace: str,
    start_operator: StartOperator,
    client_host: podnetwork.Host,
    tmp_path: Path,
    source: str,
) -> None:
    """The load rule holds bulk while requests arrive faster than 20/s. A signal source that
    stops answering is missing signal, not evidence: the rule keeps holding for the grace period,
    then the default profile applies, the condition says why, and the rule takes over again once
    the source is back."""
    ips = fleet.start_tritons(kube, namespace, 1)
    ((pod, ip),) = ips.items()
    start_operator(interval=2.0)
    rule = {"profile": "bulk", "metric": "requestRate", "above": 20, "below": 10, "for": "2s"}
    with (
        signal_source(source, namespace, pod, ip, tmp_path) as (load, silence, restore),
        clients.load_on_each(client_host, ips, rate=50) as loads,
    ):
        operators.apply_policy(
            kube,
            namespace,
            fleet.policy(defaultProfile="interactive", load={**load, "rules": [rule]}),
        )
        waiting.wait_for("bulk under load", fleet.everyone_serves(ips, "bulk"), timeout=60)
        silence()
        silenced_at = time.monotonic()

        def signals_unavailable() -> dict[str, Any] | None:
            status = operators.policy_status(kube, namespace, "fleet")
            found = operators.condition(status, "SignalsUnavailable")
            return found if found.get("status") == "True" else None

        unavailable = waiting.wait_for("SignalsUnavailable", signals_unavailable, timeout=30)
        assert fleet.served_profile(ip) == "bulk", "let go before the grace period"
        waiting.wait_for(
            "interactive once the grace period is over",
            fleet.everyone_serves(ips, "interactive"),
            timeout=90,
        )
        fell_back_after = time.monotonic() - silenced_at
        restore()
        restored_at = time.monotonic()
        waiting.wait_for("bulk again", fleet.everyone_serves(ips, "bulk"), timeout=60)
        back_after = time.monotonic() - restored_at
        waiting.wait_for(
            "SignalsUnavailable cleared",
            lambda: signals_unavailable() is None,
            timeout=30,
        )
    records = loads.records[pod]
    print(
        f"\n{source} silent: {unavailable['message']!r}; interactive {fell_back_after:.1f} s "
        f"after, bulk {back_after:.1f} s after it was back; "
        f"{len(failures(records))} of {len(records)} requests failed"
    )
    assert fell_back_after >= 30 - 2, "the rule let go before its grace period"
    assert failures(records) == []


@pytest.mark.timeout(240)
@pytest.mark.cluster_wide  # stops the API server or etcd under every namespace
@pytest.mark.parametrize("component", ["kube-apiserver", "etcd"])
def test_after_a_control_plane_restart_watches_resume_and_the_next_boundary_is_met(
    kube: Kube,
    namespace: str,
    start_operator: StartOperator,
    client_host: podnetwork.Host,
    local_cluster: controlplane.Cluster,
    component: str,
) -> None:
    """The API is down for 5 s. After it: a spec change reaches the operator (its watch came
    back), the change's own end (an override expiring) is met on time, and the operator does
    not storm the API server with reconciles."""
    interval = 2.0
    # Clients straight to the Pods make every drain run to its timeout: keep that short.
    quick: dict[str, Any] = {"rollout": {"maxUnavailable": 2, "drainTimeoutSeconds": 1}}
    ips = fleet.start_tritons(kube, namespace, 2, gated=True)
    operator = start_operator(interval=interval)
    operators.apply_policy(kube, namespace, fleet.policy(**quick))
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    with clients.load_on_each(client_host, ips, rate=20) as loads:
        before = operator.decisions_made()
        unavailable = controlplane.restart(local_cluster, component, down_seconds=5)
        restarted_at = time.monotonic()
        until = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        until += datetime.timedelta(seconds=25)
        override = {**INTERACTIVE, "until": until.strftime("%Y-%m-%dT%H:%M:%SZ")}
        operators.apply_policy(kube, namespace, fleet.policy(**quick, override=override))
        waiting.wait_for(
            "interactive: the watch is back",
            fleet.everyone_serves(ips, "interactive"),
            timeout=60,
        )
        seen_after = time.monotonic() - restarted_at
        time.sleep(max((until - datetime.datetime.now(datetime.UTC)).total_seconds(), 0))
        waiting.wait_for(
            "bulk once the override expired", fleet.everyone_serves(ips, "bulk"), timeout=30
        )
        late = (datetime.datetime.now(datetime.UTC) - until).total_seconds()
        reconciles = operator.decisions_made() - before
        elapsed = time.monotonic() - restarted_at + unavailable
        waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    failed = {pod: failures(loads.records[pod]) for pod in ips}
    print(
        f"\n{component} down {unavailable:.1f} s: the next change served {seen_after:.1f} s "
        f"after it was back, the override's end met {late:.1f} s late, {reconciles:.0f} "
        f"reconciles in {elapsed:.0f} s (interval {interval:g} s); failed requests "
        f"{ {pod: len(f) for pod, f in failed.items()} }"
    )
    assert operator.alive()
    assert late <= interval + 5, "the override's end was missed"
    # One pass per interval, one per spec change and Pod change, and a few retries: no storm.
    assert reconciles <= 3 * elapsed / interval + 10, "a reconcile storm"
    assert all(f == [] for f in failed.values()), failed


@pytest.mark.timeout(240)
def test_the_leader_stopped_while_a_gate_is_false_leaves_the_follower_to_restore_it(
    kube: Kube, namespace: str, start_operator: StartOperator
) -> None:
    """Deleting the active operator's Pod sends it SIGTERM: kopf cancels its rollout, perhaps
    with a Pod out of its Services; the follower that takes over must bring it back."""
    operators.create_peering(kube, namespace)
    ips = fleet.start_tritons(kube, namespace, 3, gated=True)
    leader = start_operator(standalone=False, extra=["--priority", "20", *SETTLE])
    follower = start_operator(standalone=False, extra=["--priority", "10", *SETTLE])
    operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME))
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME, override=INTERACTIVE))
    waiting.wait_for(
        "a Pod out of its Services",
        lambda: not fleet.all_gates_open(kube, namespace, ips)(),
        timeout=40,
        interval=0.05,
    )
    leader.stop()
    left = {pod for pod in ips if not fleet.gate_open(kube, namespace, pod)}
    waiting.wait_for(
        "interactive everywhere", fleet.everyone_serves(ips, "interactive"), timeout=90
    )
    waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
    print(f"\nthe leader stopped with {sorted(left) or 'no'} gate(s) False")
    assert "Resuming operations after the pause" in follower.log


@pytest.mark.timeout(300)
@pytest.mark.cluster_wide  # stops the node every Pod runs on
@pytest.mark.parametrize("component", ["kubelet", "containerd"])
def test_the_node_s_kubelet_or_runtime_restarted_mid_rollout_fails_no_request(
    kube: Kube,
    namespace: str,
    start_operator: StartOperator,
    client_host: podnetwork.Host,
    local_cluster: controlplane.Cluster,
    component: str,
) -> None:
    """Through a Service, with a rollout under way: the node's kubelet (or its container
    runtime) stops and starts again. The containers keep running (their shims outlive both),
    so no request fails, no container restarts, and the rollout ends with every Pod on the
    decided profile, Ready and behind the Service."""
    ips = start_fleet(kube, namespace, start_operator, 3)
    service_ip = behind_a_service(kube, namespace, ips, client_host)
    load = clients.ClientProcess(
        client_host,
        style="new-connection",
        address=f"{service_ip}:{endpoints.TRITON_HTTP_PORT}",
        rate=50,
        seed=5,
    )
    with load:
        load.start()
        time.sleep(2)
        operators.apply_policy(kube, namespace, fleet.policy(**ONE_AT_A_TIME, override=INTERACTIVE))
        waiting.wait_for("the rollout under way", some_switched(ips, "interactive"), timeout=40)
        away = controlplane.restart(local_cluster, component, down_seconds=2)
        restarted_at = time.monotonic()
        waiting.wait_for(
            "interactive everywhere", fleet.everyone_serves(ips, "interactive"), timeout=120
        )
        done_after = time.monotonic() - restarted_at
        waiting.wait_for("every gate True", fleet.all_gates_open(kube, namespace, ips), timeout=30)
        waiting.wait_for(
            "every Pod Ready",
            lambda: all(
                fleet.pod_condition(kube, namespace, pod, "Ready") == "True" for pod in ips
            ),
            timeout=30,
        )
        waiting.wait_for(
            "every Pod behind the Service again",
            lambda: fleet.ready_endpoints(kube, namespace, "triton") == set(ips.values()),
            timeout=30,
        )
        time.sleep(2)
        records = load.stop()
    failed = failures(records)
    restarts = {pod: container_restarts(kube, namespace, pod) for pod in ips}
    print(
        f"\n{component} restarted mid-rollout: away {away:.1f} s; every Pod interactive "
        f"{done_after:.1f} s after it was back; {len(records)} requests through the Service, "
        f"{len(failed)} failed; container restarts {restarts}"
    )
    assert len(records) > 500
    assert failed == [], failed[:5]
    assert all(counts == [0, 0] for counts in restarts.values()), restarts
