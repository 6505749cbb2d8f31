"""Joining by label (issue 42): the admission webhook on the cluster's real node.

A user's Triton Deployment, with nothing of batchpilot's in it, opts in with the label
`batchpilot.dev/inject: "true"` on its Pod template (and an annotation asking for Triton's
restricted-API flags); its new Pods come out of admission with the sidecar, the readiness gate,
the governed label, named ports, the flags and the credential's environment, and a policy
switches them with no failed request. With the webhook down, a new Pod of the same Deployment
is created as written (`failurePolicy: Ignore`), serves, and is not governed, as the docs say,
until it is replaced.

The operator runs as a host process, as its ServiceAccount, serving the webhook on 127.0.0.1
with a certificate made for the test (`batchpilot_testbed.webhooks`); the API server, on this
host too, calls it there. The chart's path (Service, certificates) is test_install's.
"""

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot.admission import injections
from batchpilot.api import names
from batchpilot.kube import pods
from batchpilot_cluster import podnetwork
from batchpilot_testbed import fleet, hitless, operators, waiting, webhooks
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess
from batchpilot_triton import endpoints

pytestmark = pytest.mark.e2e

CREDENTIAL = "triton-repository-credential"
APP = {"app": "triton"}
SELECTOR = "app=triton"
OPT_IN = {names.INJECT_LABEL: names.INJECT_VALUE}
FLAGS = {
    names.TRITON_FLAGS_ANNOTATION: injections.RESTRICTED,
    # The CPU Triton image's tag is a digest of its inputs: the version is said, not read.
    names.TRITON_VERSION_ANNOTATION: "2.51",
}
RATE = 40.0


class Joining:
    """The test's webhook, operator and Deployment."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        start_operator: Callable[..., OperatorProcess],
        directory: Path,
    ) -> None:
        self.kube, self.namespace, self._start = kube, namespace, start_operator
        self.placement = fleet.placement(kube)
        self.hook = webhooks.HostWebhook(
            directory,
            sidecar_image=self.placement.sidecar_image,
            own_namespace=operators.SYSTEM_NAMESPACE,
        )
        self.operator = self.start_operator()

    def start_operator(self) -> OperatorProcess:
        self.operator = self._start(extra=self.hook.arguments)
        return self.operator

    def configuration(self) -> dict[str, Any]:
        return webhooks.configuration(
            f"batchpilot-{self.namespace}",
            url=self.hook.url,
            ca=self.hook.ca,
            namespace=self.namespace,
        )

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        done = self.kube.kubectl_run(*args, "-n", self.namespace, stdin=stdin, timeout=60)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def prepare(self) -> None:
        """The credential's Secret and a policy over the Deployment's Pods, first: a gated Pod
        is Ready only once a policy governs it, and the rollout waits for each new Pod."""
        token = secrets.token_hex(32)
        self.kubectl("create", "secret", "generic", CREDENTIAL, f"--from-literal=token={token}")
        spec = {
            "target": {
                **fleet.BASE_SPEC["target"],
                "selector": {"matchLabels": APP},
                "repositoryCredential": {"secretName": CREDENTIAL},
            },
            "rollout": {"maxUnavailable": 1},
        }
        operators.apply_policy(self.kube, self.namespace, fleet.policy("triton", **spec))

    def deploy(self, *, replicas: int, opted_in: bool) -> None:
        deployment = fleet.users_deployment(
            "triton",
            placement=self.placement,
            replicas=replicas,
            labels=APP,
            template_labels=OPT_IN if opted_in else None,
            annotations=FLAGS if opted_in else None,
        )
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(deployment))

    def pods(self) -> list[Any]:
        listed = self.kube.core.list_namespaced_pod(self.namespace, label_selector=SELECTOR)
        return [pod for pod in listed.items if pod.metadata and not pod.metadata.deletion_timestamp]

    def ready(self, count: int, *, injected: bool | None = None) -> dict[str, Any] | None:
        """`count` Pods, each Ready (and injected or not, if asked); by name."""
        found = self.pods()
        if len(found) != count:
            return None
        for pod in found:
            if condition(pod, "Ready") != "True":
                return None
            if injected is not None and is_injected(pod) != injected:
                return None
        return {pod.metadata.name: pod for pod in found}


def condition(pod: Any, kind: str) -> str | None:
    for item in (pod.status.conditions if pod.status else None) or []:
        if item.type == kind:
            return str(item.status)
    return None


def is_injected(pod: Any) -> bool:
    return bool((pod.metadata.labels or {}).get(names.GOVERNED_LABEL) == names.GOVERNED_VALUE)


def check_injected(pod: Any) -> None:
    """Everything manifests/triton-deployment.yaml wires by hand, in the Pod as admitted."""
    spec = pod.spec
    by_name = {container.name: container for container in spec.containers}
    assert set(by_name) == {"triton", injections.SIDECAR_CONTAINER}, set(by_name)
    assert [gate.condition_type for gate in spec.readiness_gates or []] == [pods.GATE]
    triton = by_name["triton"]
    assert {port.name: port.container_port for port in triton.ports} == {
        "http": endpoints.TRITON_HTTP_PORT,
        "grpc": endpoints.TRITON_GRPC_PORT,
        "metrics": endpoints.TRITON_METRICS_PORT,
    }
    assert injections.restricted_flags(injections.RESTRICTED_SINCE) == triton.args[-2:]
    (token,) = [v for v in triton.env or [] if v.name == injections.TOKEN_VARIABLE]
    assert token.value_from.secret_key_ref.name == CREDENTIAL
    sidecar = by_name[injections.SIDECAR_CONTAINER]
    assert [(port.name, port.container_port) for port in sidecar.ports] == [
        ("sidecar", endpoints.SIDECAR_PORT)
    ]
    assert sidecar.security_context.read_only_root_filesystem
    assert sidecar.security_context.run_as_non_root
    assert pod.metadata.annotations[names.INJECTED_ANNOTATION]


def repository_locked(ip: str) -> bool:
    """Triton refuses its repository index without the operator's header."""
    request = urllib.request.Request(f"{fleet.triton_url(ip)}/v2/repository/index", method="POST")
    try:
        with urllib.request.urlopen(request, data=b"{}", timeout=5):
            return False
    except urllib.error.HTTPError as error:
        return "restricted" in error.read().decode(errors="replace")


@pytest.fixture
def joining(
    kube: Kube,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    triton_pods: None,
    tmp_path: Path,
) -> Iterator[Joining]:
    if kube.local is None:
        pytest.skip("the API server must reach the host's loopback (the local cluster)")
    made = Joining(kube, namespace, start_operator, tmp_path / "webhook")
    with webhooks.configured(kube, made.configuration()):
        yield made


@pytest.mark.timeout(240)
def test_an_unmodified_deployment_labelled_after_install_is_injected_and_switched_hitlessly(
    joining: Joining, kube: Kube, namespace: str, client_host: podnetwork.Host
) -> None:
    # A Deployment that knows nothing of batchpilot serves as it is, behind its Service.
    cluster_ip = fleet.create_service(kube, namespace, selector=APP)
    joining.deploy(replicas=2, opted_in=False)
    before = waiting.wait_for("2 plain Triton Pods Ready", lambda: joining.ready(2), timeout=90)
    assert not any(is_injected(pod) for pod in before.values())
    joining.prepare()

    # The opt-in: a label (and the flags asked for) on its Pod template, nothing else.
    template = {"metadata": {"labels": OPT_IN, "annotations": FLAGS}}
    joining.kubectl(
        "patch", "deployment", "triton", "-p", json.dumps({"spec": {"template": template}})
    )
    joined = waiting.wait_for(
        "2 injected Pods Ready through their gates, the old ones gone",
        lambda: joining.ready(2, injected=True),
        timeout=120,
        interval=0.5,
    )
    ips = {name: pod.status.pod_ip for name, pod in joined.items()}
    for pod in joined.values():
        check_injected(pod)
        assert condition(pod, pods.GATE) == "True"
        assert repository_locked(pod.status.pod_ip)
    waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=60)
    waiting.wait_for(
        "both Pods behind the Service",
        lambda: fleet.ready_endpoints(kube, namespace, "triton") == set(ips.values()),
        timeout=30,
    )

    # A switch under load through the Service: each Pod leaves it, reloads, comes back.
    patched = json.dumps({"spec": {"override": {"profile": "interactive", "reason": "e2e"}}})
    switched = hitless.switch_to_interactive(
        kube,
        namespace,
        ips,
        switch=lambda: joining.kubectl("patch", "bp", "triton", "--type=merge", "-p", patched),
        client_host=client_host,
        service_ip=cluster_ip,
        selector=SELECTOR,
        rate=RATE,
        seed=42,
    )
    switched.assert_hitless(ips, rate=RATE)


@pytest.mark.timeout(240)
def test_a_pod_created_while_the_webhook_is_down_serves_ungoverned_until_replaced(
    joining: Joining, kube: Kube, namespace: str
) -> None:
    joining.prepare()
    joining.deploy(replicas=1, opted_in=True)
    (first,) = waiting.wait_for(
        "1 injected Pod Ready", lambda: joining.ready(1, injected=True), timeout=120
    ).values()
    first_ip = first.status.pod_ip
    waiting.wait_for("bulk on it", fleet.everyone_serves({"a": first_ip}, "bulk"), timeout=60)
    fleet.create_service(kube, namespace, selector=APP)

    # The operator, and its webhook with it, dies; the Deployment scales up meanwhile.
    joining.operator.kill()
    joining.kubectl("scale", "deployment", "triton", "--replicas=2")
    pods_now = waiting.wait_for("2 Pods Ready", lambda: joining.ready(2), timeout=90)
    (late,) = [pod for name, pod in pods_now.items() if name != first.metadata.name]
    late_ip = late.status.pod_ip
    # Created as written: no sidecar, no gate, no flags; Ready and serving all the same.
    assert not is_injected(late)
    assert [c.name for c in late.spec.containers] == ["triton"]
    assert not late.spec.readiness_gates
    assert not repository_locked(late_ip)
    assert fleet.answers(f"{fleet.triton_url(late_ip)}/v2/models/{fleet.MODEL}/ready")
    waiting.wait_for(
        "both Pods behind the Service",
        lambda: fleet.ready_endpoints(kube, namespace, "triton") == {first_ip, late_ip},
        timeout=30,
    )
    print(f"Pods serving with the webhook down: 2 of 2 ({first_ip}, {late_ip})")

    # Back up: the operator governs the Pod it injected and leaves the other one alone, and the
    # policy's status names the one it cannot switch, and what to do.
    operator = joining.start_operator()
    waiting.wait_for("two passes of the policy", lambda: operator.decisions_made() >= 2, timeout=30)
    status = operators.policy_status(kube, namespace, "triton")
    assert (status.get("targets") or {})["total"] == 1
    not_injected = operators.condition(status, "PodsNotInjected")
    assert (not_injected["status"], not_injected["reason"]) == ("True", "CreatedWithoutInjection")
    assert not_injected["message"].startswith(f"{late.metadata.name}: opted in ("), not_injected
    assert "Delete them: their replacements are injected" in not_injected["message"]
    assert fleet.served_profile(first_ip) == "bulk"
    assert fleet.served_profile(late_ip) is None  # the repository's own configuration
    assert fleet.ready_endpoints(kube, namespace, "triton") == {first_ip, late_ip}

    # What the docs say to do: delete it; its replacement is injected and governed.
    joining.kubectl("delete", "pod", late.metadata.name, "--wait=false")
    replaced = waiting.wait_for(
        "2 injected Pods Ready", lambda: joining.ready(2, injected=True), timeout=120
    )
    ips = {name: pod.status.pod_ip for name, pod in replaced.items()}
    waiting.wait_for("bulk on both", fleet.everyone_serves(ips, "bulk"), timeout=60)
    # The replacement's arrival has the namespace listed again: nothing left uninjected.
    waiting.wait_for(
        "PodsNotInjected False",
        lambda: (
            operators.condition(
                operators.policy_status(kube, namespace, "triton"), "PodsNotInjected"
            ).get("status")
            == "False"
        ),
        timeout=30,
    )
