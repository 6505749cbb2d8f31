"""A tenant with namespaced rights only, against a locked Triton (issue 39, findings 1, 3, 4).

The tenant is a ServiceAccount of its namespace that may write BatchPolicies and their status
there, nothing else: it cannot read the Secret that locks its Triton's model repository. Through
the API server it tries what would have given it the Secret's value, or had the operator load
what it chose: a header HTTP acts on, the sidecar's port named as Triton's, a Prometheus URL
carrying its own query, and a status whose served settings carry engine arguments. It gets
refusals, and nothing it can read (its policies, its namespace's events) nor the operator's
log carries the value. (Redirects are the unit tests': no Pod here answers with one.)
"""

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from batchpilot_testbed import fleet, operators, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_testbed.operators import OperatorProcess
from batchpilot_triton import endpoints

pytestmark = pytest.mark.e2e

SECRET = "triton-repository-credential"
GATE = "batchpilot.dev/config-applied"
CANARY = {"replicas": 1, "analysisSeconds": 30, "minRequests": 100}


def tenant_of(kube: Kube, namespace: str, path: Path) -> Kube:
    """A ServiceAccount of `namespace` that may write BatchPolicies and their status there."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "policy-author"},
        "rules": [
            {
                "apiGroups": ["batchpilot.dev"],
                "resources": ["batchpolicies", "batchpolicies/status"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            },
            {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "policy-author"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "policy-author",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}],
    }
    created = kube.kubectl_run("create", "serviceaccount", "tenant", "-n", namespace)
    assert created.returncode == 0, created.stderr
    for document in (role, binding):
        operators.apply_policy(kube, namespace, document)
    operators.service_account_kubeconfig(kube, path, service_account="tenant", namespace=namespace)
    return Kube(kubeconfig=path, context=f"tenant@{kube.context}", local=None)


def credential_secret(kube: Kube, namespace: str, token: str) -> None:
    created = kube.kubectl_run(
        "create", "secret", "generic", SECRET, "-n", namespace, f"--from-literal=token={token}"
    )
    assert created.returncode == 0, created.stderr


def locked_policy(name: str, pod: str, **target: Any) -> dict[str, Any]:
    return fleet.policy(
        name,
        target={
            **fleet.BASE_SPEC["target"],
            "selector": {"matchLabels": {"tenant-pod": pod}},
            "repositoryCredential": {"secretName": SECRET},
            **target,
        },
        rollout={"maxUnavailable": 1, "canary": CANARY},
    )


def applied(tenant: Kube, namespace: str, document: dict[str, Any]) -> tuple[int, str]:
    done = tenant.kubectl_run("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(document))
    return done.returncode, done.stderr


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("triton_pods")
def test_a_tenant_gets_nothing_of_the_credential_back_and_cannot_choose_what_loads(
    kube: Kube,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    token = secrets.token_hex(16)
    credential_secret(kube, namespace, token)
    ips = fleet.start_tritons(kube, namespace, 2, repository_secret=SECRET)
    for pod in ips:
        labelled = {"metadata": {"labels": {"tenant-pod": pod}}}
        kube.core.patch_namespaced_pod(pod, namespace, labelled)
    tenant = tenant_of(kube, namespace, tmp_path / "tenant-kubeconfig")
    assert tenant.kubectl_run("get", "secret", SECRET, "-n", namespace).returncode != 0

    # A header HTTP acts on (the sidecar's server quoted it back, value and all): refused.
    for header in ("content-length", "expect"):
        code, said = applied(
            tenant,
            namespace,
            locked_policy(
                "echo",
                "triton-0",
                port=endpoints.SIDECAR_PORT,
                repositoryCredential={"secretName": SECRET, "header": header},
            ),
        )
        assert code != 0
        assert "repositoryCredential.header" in said, said
    # A Prometheus URL with a query of the tenant's own: refused.
    code, said = applied(
        tenant,
        namespace,
        fleet.policy(
            "smuggled",
            load={
                "source": "prometheus",
                "prometheus": {"url": "http://10.0.0.1:9090/api/v1/query?query=vector(1e9)#"},
            },
        ),
    )
    assert code != 0
    assert "prometheus.url" in said, said

    operator = start_operator(interval=1.0)
    # The sidecar's port named as Triton's, with a header it takes: the credential is not sent.
    code, said = applied(
        tenant, namespace, locked_policy("sidecar-port", "triton-0", port=endpoints.SIDECAR_PORT)
    )
    assert code == 0, said
    # The same Secret on the real port: the fleet switches, and its served settings are recorded.
    code, said = applied(tenant, namespace, locked_policy("fleet", "triton-1"))
    assert code == 0, said

    def refused() -> dict[str, Any] | None:
        status = operators.policy_status(tenant, namespace, "sidecar-port")
        condition = operators.condition(status, "CredentialRefused")
        return condition if condition.get("status") == "True" else None

    condition = waiting.wait_for("the sidecar-port policy refused", refused, timeout=60)
    assert "spec.target.port must name Triton's HTTP port" in condition["message"], condition

    def served() -> dict[str, Any] | None:
        settings = operators.policy_status(tenant, namespace, "fleet").get("settings") or {}
        return settings if settings.get("served") else None

    history = waiting.wait_for("the fleet's served settings in its status", served, timeout=60)
    assert fleet.served_profile(ips["triton-1"]) == "bulk"

    # The status as input: the tenant writes engine arguments into the served settings while
    # the operator is down; the operator that comes back does not take them.
    operator.stop()
    document = json.loads(history["served"])
    document["engineArguments"] = {"trust_remote_code": True, "model": "attacker/model"}
    patch = {"status": {"settings": {"served": json.dumps(document)}}}
    patched = tenant.kubectl_run(
        "patch", "bp", "fleet", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip
    assert patched.returncode == 0, patched.stderr
    restarted = start_operator(interval=1.0)

    def untampered() -> dict[str, Any] | None:
        settings = operators.policy_status(tenant, namespace, "fleet").get("settings") or {}
        return settings if "trust_remote_code" not in settings.get("served", "") else None

    waiting.wait_for("the tampered served settings dropped", untampered, timeout=60)

    # Nothing the tenant reads, nor the operator's log, carries the value.
    readable = {
        "policies": tenant.kubectl("get", "bp", "-n", namespace, "-o", "yaml"),
        "events": tenant.kubectl("get", "events", "-n", namespace, "-o", "yaml"),
        "operator logs": operator.log + restarted.log,
    }
    assert [where for where, text in readable.items() if token in text] == []


@pytest.mark.timeout(60)
def test_the_operator_may_set_the_status_only_of_pods_with_its_readiness_gate(
    kube: Kube, namespace: str, operator_kubeconfig: Path
) -> None:
    """RBAC lets the operator patch pods/status of every Pod it serves; the chart's admission
    policy narrows that to the Pods that opted into its gate (kube-system's, say, never)."""
    for name, gates in (
        ("gated", [client.V1PodReadinessGate(condition_type=GATE)]),
        ("plain", None),
    ):
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(
                containers=[client.V1Container(name="main", image="none")],
                readiness_gates=gates,
            ),
        )
        kube.core.create_namespaced_pod(namespace, pod)
    operator = Kube(
        kubeconfig=operator_kubeconfig,
        context=f"{operators.SERVICE_ACCOUNT}@{kube.context}",
        local=None,
    )
    condition = {"status": {"conditions": [{"type": GATE, "status": "True"}]}}

    def patch(pod: str) -> None:
        # As the operator writes its gate: a strategic merge of the condition, no read first.
        operator.core.patch_namespaced_pod_status(
            pod, namespace, condition, _content_type="application/strategic-merge-patch+json"
        )

    patch("gated")
    with pytest.raises(client.ApiException) as refused:
        patch("plain")
    assert refused.value.status == 403
    assert "only of Pods with its readiness gate" in str(refused.value.body)
