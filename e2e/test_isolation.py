"""A hostile tenant against the fleet: one operator, two namespaces, real Pods on the pod network.

The tenant's policies select a Pod that floods every read the operator makes of it (its Triton
and sidecar ports answer with 500 MB) and name a Prometheus there that trickles one byte at a
time. Another namespace's policy has a schedule boundary meanwhile: it must switch on time, the
operator must stay within the memory the chart gives it, and the tenant must be told why its
policies get no signals, without the operator echoing what its servers sent.
"""

import datetime
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from batchpilot_cluster import realnodes
from batchpilot_testbed import fleet, hostile_servers, namespaces, operators, waiting
from batchpilot_testbed.hostile_servers import PROMETHEUS_PORT
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess
from batchpilot_triton import endpoints

# What one tenant costs the others is measured on a cluster that runs nothing else.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.cluster_wide,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("triton_pods"),
]

CHART_VALUES = Path(__file__).resolve().parents[1] / "charts" / "batchpilot" / "values.yaml"
MIB = 1024 * 1024


def operator_memory_limit() -> int:
    """The operator container's memory limit in the chart, in bytes."""
    values = yaml.safe_load(CHART_VALUES.read_text())
    limit = str(values["resources"]["limits"]["memory"])
    assert limit.endswith("Mi"), limit
    return int(limit[:-2]) * MIB


SERVERS_CONFIGMAP = "hostile-servers"
SERVERS_SOURCE = Path(hostile_servers.__file__)


def hostile_pod(name: str, labels: dict[str, str], placement: fleet.Placement) -> client.V1Pod:
    """The tenant's servers (`batchpilot_testbed.hostile_servers`, from a ConfigMap) in the
    sidecar's image, which has Python and the ports' numbers (batchpilot_triton)."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="main",
                    image=placement.sidecar_image,
                    image_pull_policy="Never",
                    command=["python", f"/hostile/{SERVERS_SOURCE.name}"],
                    args=["--host", endpoints.EVERY_ADDRESS],
                    # Named as a Triton Pod's are, so that the policies read every port.
                    ports=[
                        client.V1ContainerPort(name=name, container_port=port)
                        for name, port in (
                            ("http", endpoints.TRITON_HTTP_PORT),
                            ("metrics", endpoints.TRITON_METRICS_PORT),
                            ("sidecar", endpoints.SIDECAR_PORT),
                        )
                    ],
                    volume_mounts=[
                        client.V1VolumeMount(name="servers", mount_path="/hostile", read_only=True)
                    ],
                )
            ],
            volumes=[
                client.V1Volume(
                    name="servers",
                    config_map=client.V1ConfigMapVolumeSource(name=SERVERS_CONFIGMAP),
                )
            ],
            node_selector=placement.node_selector,
            tolerations=[
                client.V1Toleration(key=realnodes.TAINT_KEY, operator="Exists", effect="NoSchedule")
            ],
            enable_service_links=False,
            automount_service_account_token=False,
            termination_grace_period_seconds=2,
        ),
    )


def start_hostile_pod(kube: Kube, namespace: str) -> str:
    """The tenant's Pod, its servers listening; its IP."""
    kube.core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=SERVERS_CONFIGMAP),
            data={SERVERS_SOURCE.name: SERVERS_SOURCE.read_text()},
        ),
    )
    kube.core.create_namespaced_pod(
        namespace,
        hostile_pod("hostile", {"app": "hostile", **fleet.GOVERNED_LABELS}, fleet.placement(kube)),
    )

    def ip() -> str | None:
        status = kube.core.read_namespaced_pod("hostile", namespace).status
        return (status.pod_ip or None) if status is not None else None

    waiting.wait_for("the hostile pod's IP", ip, timeout=60)
    address = ip()
    assert address is not None
    waiting.wait_for(
        "the hostile pod's servers",
        lambda: fleet.answers(f"http://{address}:{PROMETHEUS_PORT}/-/healthy"),
        timeout=60,
    )
    return address


class PeakMemory:
    """The operator's resident memory, sampled while the test runs, and its peak (VmHWM)."""

    def __init__(self, operator: OperatorProcess) -> None:
        self.status = Path(f"/proc/{operator.process.pid}/status")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _read(self, field: str) -> int:
        for line in self.status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, self._read("VmHWM"))
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def signals_condition(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    status = operators.policy_status(kube, namespace, name)
    for condition in status.get("conditions") or []:
        if condition.get("type") == "SignalsUnavailable" and condition.get("status") == "True":
            return dict(condition)
    return None


def test_a_hostile_tenant_delays_no_other_policy_and_cannot_exhaust_the_operator(
    kube: Kube, namespace: str, start_operator: Any
) -> None:
    interval = 3.0
    victims = fleet.start_tritons(kube, namespace, 2, labels={"app": "victim"}, prefix="victim")
    with namespaces.created(
        kube, namespaces.unique("e2e-hostile-tenant"), label="batchpilot.dev/e2e"
    ) as tenant:
        address = start_hostile_pod(kube, tenant)
        operator = start_operator(interval=interval, namespaces=[namespace, tenant])
        memory = PeakMemory(operator)
        hostile_target = {
            **fleet.BASE_SPEC["target"],
            "selector": {"matchLabels": {"app": "hostile"}},
        }
        rule = {"profile": "interactive", "metric": "requestRate", "above": 1}
        # One policy reads the flooding sidecar, one asks the trickling Prometheus; both govern
        # the Pod whose Triton port floods too.
        operators.apply_policy(
            kube, tenant, fleet.policy("flood", target=hostile_target, load={"rules": [rule]})
        )
        prometheus = {"url": f"http://{address}:{PROMETHEUS_PORT}"}
        operators.apply_policy(
            kube,
            tenant,
            fleet.policy(
                "trickle",
                target=hostile_target,
                load={"source": "prometheus", "prometheus": prometheus, "rules": [rule]},
            ),
        )

        opens, window = fleet.interactive_window()
        victim_target = {
            **fleet.BASE_SPEC["target"],
            "selector": {"matchLabels": {"app": "victim"}},
        }
        schedule = {"timezone": "UTC", "windows": [window], "leadTime": "auto"}
        operators.apply_policy(
            kube, namespace, fleet.policy("victim", schedule=schedule, target=victim_target)
        )
        waiting.wait_for("bulk on every victim", fleet.everyone_serves(victims, "bulk"), timeout=60)

        waiting.wait_for(
            "the tenant's policies told why they get no signals",
            lambda: (
                signals_condition(kube, tenant, "flood") is not None
                and signals_condition(kube, tenant, "trickle") is not None
            ),
            timeout=90,
        )
        planned = operators.policy_status(kube, namespace, "victim")
        rollout_start = datetime.datetime.fromisoformat(planned["plannedRolloutStart"])
        time.sleep(
            max((rollout_start - datetime.datetime.now(datetime.UTC)).total_seconds() - 1, 0)
        )
        waiting.wait_for(
            "interactive on every victim",
            fleet.everyone_serves(victims, "interactive"),
            timeout=60,
            interval=0.05,
        )
        switched_after = (datetime.datetime.now(datetime.UTC) - opens).total_seconds()
        peak = memory.stop()
        flood = signals_condition(kube, tenant, "flood")
        trickle = signals_condition(kube, tenant, "trickle")
        alive, healthy = operator.alive(), operator.healthy()

    print(
        f"\nvictim fleet served interactive {switched_after:+.2f}s after its window opened; "
        f"operator peak RSS {peak / MIB:.0f} MiB (limit {operator_memory_limit() / MIB:.0f} MiB)"
        f"\nflood: {flood and flood['message']}\ntrickle: {trickle and trickle['message']}"
    )
    assert alive
    assert healthy
    assert switched_after <= 0
    assert peak < operator_memory_limit()
    assert flood is not None
    assert trickle is not None
    assert "larger than" in flood["message"]
    assert "within" in trickle["message"]
    for condition in (flood, trickle):
        # Said in a sentence, never echoed: no run of the flood's bytes reaches the status.
        assert 0 < len(condition["message"]) <= 1024
        assert "aaaaaaaa" not in condition["message"]
