"""The install path on kind (`make e2e-kind`): the chart's operator in the cluster, the example
Triton Deployment, a policy, a fleet switched and back under load through a Service; then the
faults a kind node can take: the operator Pod deleted and a Triton Pod killed, each while the
fleet is governed, and the fleet still following the policy after each.

The images are the archives `python -m batchpilot_testbed.kind up` loaded into the node (their
references come in the environment, as for test_canary's Tritons). The node advertises
`nvidia.com/gpu` through its status capacity, as on the local cluster's real node; the model
repository is this checkout's, mounted into the node at MODEL_PATH by the cluster's config. The
clients sit in a network namespace of their own, as on the local cluster, and reach the Service
through the host's routes to the node (kube-proxy in the node translates).
"""

import contextlib
import json
import os
import secrets
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from batchpilot_cluster import podnetwork
from batchpilot_testbed import charts, clients, fleet, namespaces, waiting
from batchpilot_testbed.kind import clusters
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import endpoints
from e2e import test_install as install

pytestmark = pytest.mark.e2e

RATE = 30.0
"""Requests per second through the Service (the kind node and the test share two cores)."""


@pytest.fixture
def kind(kube: Kube) -> Kube:
    if not clusters.is_kind(kube.context) or not os.environ.get(fleet.TRITON_IMAGE_ENV):
        pytest.skip("needs the kind cluster and images of `python -m batchpilot_testbed.kind up`")
    return kube


@pytest.fixture
def service_client(kind: Kube) -> Iterator[podnetwork.Host]:
    """A network namespace for clients of Services, routed to kind's networks via the host."""
    with podnetwork.client_host(routes=clusters.NETWORKS) as host:
        yield host


def values(operator_image: str) -> dict[str, object]:
    repository, tag = operator_image.rsplit(":", 1)
    return {"image": {"repository": repository, "tag": tag, "pullPolicy": "Never"}}


def model_volume(namespace: str, name: str) -> str:
    """The install test's volume and claim, over the repository as the kind node mounts it."""
    documents = list(yaml.safe_load_all(install.model_volume(namespace, name)))
    documents[0]["spec"]["hostPath"]["path"] = clusters.MODEL_PATH
    return yaml.safe_dump_all(documents)


@pytest.mark.timeout(900)
def test_on_kind_a_user_installs_and_a_fleet_switches_under_load_through_a_service(
    kind: Kube, service_client: podnetwork.Host, tmp_path: Path
) -> None:
    kube = kind
    suffix = uuid.uuid4().hex[:6]
    release, system, volume = f"batchpilot-{suffix}", f"bp-system-{suffix}", f"models-{suffix}"
    references = {
        install.OPERATOR_IMAGE: os.environ["BATCHPILOT_E2E_OPERATOR_IMAGE"],
        install.TRITON_IMAGE: os.environ[fleet.TRITON_IMAGE_ENV],
        install.SIDECAR_IMAGE: os.environ[fleet.SIDECAR_IMAGE_ENV],
    }
    with contextlib.ExitStack() as cleanup:
        # 1. The node advertises GPUs (the Deployment asks for one each).
        patch = ("patch", "node", clusters.NODE, "--subresource=status", "--type=json")
        removal = [{"op": "remove", "path": install.GPU_CAPACITY}]
        cleanup.callback(kube.kubectl_run, *patch, "-p", json.dumps(removal))
        advertised = [{"op": "add", "path": install.GPU_CAPACITY, "value": str(install.GPUS)}]
        install.kubectl(kube, *patch, "-p", json.dumps(advertised))

        # 2. helm install, restricted namespaces, the operator image loaded into the node.
        triton = cleanup.enter_context(
            namespaces.created(kube, f"triton-{suffix}", label="batchpilot.dev/e2e")
        )
        cleanup.enter_context(namespaces.created(kube, system, label="batchpilot.dev/e2e"))
        for namespace in (system, triton):
            install.kubectl(kube, "label", "namespace", namespace, install.RESTRICTED)
        chart_values = tmp_path / "values.yaml"
        chart_values.write_text(yaml.safe_dump(values(references[install.OPERATOR_IMAGE])))
        installing = time.monotonic()
        cleanup.callback(
            charts.helm, "uninstall", release, "-n", system, "--kubeconfig", str(kube.kubeconfig),
            "--kube-context", kube.context, "--wait", "--timeout", "60s", timeout=90,
        )  # fmt: skip
        install.helm(kube, "install", release, str(charts.CHART), "-n", system,
                     "-f", str(chart_values), "--wait", "--timeout", "240s")  # fmt: skip
        print(f"helm install --wait: {time.monotonic() - installing:.1f} s")
        operator_selector = f"app.kubernetes.io/instance={release}"
        operators = install.pod_list(kube, system, operator_selector)
        assert len(operators) == 2
        assert all(install.conditions_of(pod).get("Ready") == "True" for pod in operators)
        waiting.wait_for(
            "both replicas in the peering", lambda: len(install.peers(kube, release)) == 2
        )

        # 3. The Deployment as a user applies it, with what it asks to be created first.
        install.kubectl(kube, "create", "secret", "generic", install.CREDENTIAL, "-n", triton,
                        f"--from-literal=token={secrets.token_hex(32)}")  # fmt: skip
        cleanup.callback(kube.kubectl_run, "delete", "persistentvolume", volume, "--wait=false")
        install.kubectl(kube, "apply", "-f", "-", stdin=model_volume(triton, volume))
        deployment = tmp_path / "triton-deployment.yaml"
        deployment.write_text(
            yaml.safe_dump_all(
                install.users_deployment(
                    references[install.TRITON_IMAGE], references[install.SIDECAR_IMAGE]
                )
            )
        )
        applied = time.monotonic()
        install.kubectl(kube, "apply", "-n", triton, "-f", str(deployment))
        tritons = waiting.wait_for(
            f"{install.REPLICAS} Triton Pods with their containers Ready",
            lambda: install.containers_ready(kube, triton, install.TRITON_LABELS, install.REPLICAS),
            timeout=300,
            interval=0.5,
        )
        print(f"apply to containers Ready: {time.monotonic() - applied:.1f} s")
        ips = {pod.metadata.name: pod.status.pod_ip for pod in tritons}
        for pod in tritons:
            assert install.conditions_of(pod).get("Ready") == "False"  # the gate holds it back

        # 4. The policy; then a switch and back under load through the Service. (Deleted
        # before the uninstall: its finalizer needs the operator.)
        policy = tmp_path / "policy.yaml"
        policy.write_text(install.POLICY)
        cleanup.callback(
            kube.kubectl_run, "delete", "-n", triton, "-f", str(policy), "--timeout=60s", timeout=90
        )
        install.kubectl(kube, "apply", "-n", triton, "-f", str(policy))
        waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=120)
        service = kube.core.read_namespaced_service("triton", triton).spec
        assert service is not None
        waiting.wait_for(
            "every Pod behind the Service",
            lambda: fleet.ready_endpoints(kube, triton, "triton") == set(ips.values()),
            timeout=60,
        )
        load = clients.ClientProcess(
            service_client,
            style="new-connection",
            address=f"{service.cluster_ip}:{endpoints.TRITON_HTTP_PORT}",
            rate=RATE,
            seed=44,
        )
        with load, install.Readiness(kube, triton) as readiness:
            load.start()
            time.sleep(3)
            policy.write_text(install.POLICY + "  override: {profile: interactive, reason: e2e}\n")
            install.kubectl(kube, "apply", "-n", triton, "-f", str(policy))
            flipping = time.monotonic()
            waiting.wait_for(
                "interactive everywhere", fleet.everyone_serves(ips, "interactive"), timeout=120
            )
            waiting.wait_for(
                "every gate back", lambda: set(install.gates(kube, triton).values()) == {"True"}
            )
            flipped = time.monotonic() - flipping
            policy.write_text(install.POLICY)
            install.kubectl(kube, "apply", "-n", triton, "-f", str(policy))
            waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=120)
            waiting.wait_for(
                "every gate back", lambda: set(install.gates(kube, triton).values()) == {"True"}
            )
            time.sleep(2)
            records = load.stop()
        failures = [record for record in records if not record.succeeded]
        print(
            f"{len(records)} requests through the Service, {len(failures)} failed; flip "
            f"{flipped:.1f} s; (gate, Ready) per Pod: {readiness.history}"
        )
        assert len(records) > RATE * 5
        assert not failures, [record.error for record in failures[:5]]
        assert readiness.gate_went_false() == set(ips)
        assert install.bp_columns(kube, triton)["PROFILE"] == "bulk"

        # 5. An operator Pod deleted (a restart, as a node drain or a crash makes one): its
        # replacement joins, and a switch asked for meanwhile reaches every Pod.
        deleted = install.pod_list(kube, system, operator_selector)[0].metadata.name
        install.kubectl(kube, "delete", "pod", deleted, "-n", system, "--wait=false")
        policy.write_text(install.POLICY + "  override: {profile: interactive, reason: e2e}\n")
        install.kubectl(kube, "apply", "-n", triton, "-f", str(policy))
        waiting.wait_for(
            "interactive everywhere after the leader went",
            fleet.everyone_serves(ips, "interactive"),
            timeout=180,
        )
        waiting.wait_for(
            "two operator replicas again, none of them the deleted one",
            lambda: (
                len(found := install.pod_list(kube, system, operator_selector)) == 2
                and deleted not in {pod.metadata.name for pod in found}
                and all(install.conditions_of(pod).get("Ready") == "True" for pod in found)
            ),
            timeout=120,
        )

        # 6. A Triton Pod killed: the Deployment's new Pod is governed onto the decided profile
        # and let into the Service through its gate.
        killed = next(iter(ips))
        install.kubectl(kube, "delete", "pod", killed, "-n", triton, "--grace-period=0", "--force")
        replaced = waiting.wait_for(
            "the replacement Pod Ready through its gate",
            lambda: (
                found
                if len(found := install.pod_list(kube, triton, install.TRITON_LABELS)) == 3
                and killed not in {pod.metadata.name for pod in found}
                and all(install.conditions_of(pod).get("Ready") == "True" for pod in found)
                else None
            ),
            timeout=300,
            interval=1,
        )
        now = {pod.metadata.name: pod.status.pod_ip for pod in replaced}
        assert fleet.everyone_serves(now, "interactive")()
        assert install.bp_columns(kube, triton)["PROFILE"] == "interactive"
        waiting.wait_for(
            "every Pod behind the Service",
            lambda: fleet.ready_endpoints(kube, triton, "triton") == set(now.values()),
            timeout=60,
        )
