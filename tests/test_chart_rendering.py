"""What the chart renders for the operator's access: its RBAC (cluster-wide, or namespaced Roles
when it serves some namespaces; Secrets only by name, only `get`) and the NetworkPolicy of the
Triton Pods' sidecars. e2e/test_chart.py has a real API server accept the same renderings.

Needs helm, from `make k8s-bins`, like tests/test_generated.py."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from batchpilot_testbed import charts

RELEASE_NAMESPACE = "batchpilot-system"


@pytest.fixture(autouse=True)
def _helm() -> None:
    if not charts.helm_binary().exists():
        pytest.fail(f"no helm at {charts.helm_binary()}: run `make k8s-bins`")


def render(*sets: str) -> list[dict[str, Any]]:
    arguments = [argument for value in sets for argument in ("--set", value)]
    manifest = charts.template(*arguments, namespace=RELEASE_NAMESPACE)
    return [document for document in yaml.safe_load_all(manifest) if document]


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [document for document in documents if document["kind"] == kind]


def secret_rules(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for rule in role["rules"] if "secrets" in rule["resources"]]


@pytest.mark.timeout(60)
def test_serving_some_namespaces_the_operator_gets_roles_there_and_nothing_cluster_wide() -> None:
    documents = render("operator.namespaces={team-a,team-b}")
    assert of_kind(documents, "ClusterRole") == []
    assert of_kind(documents, "ClusterRoleBinding") == []
    roles = of_kind(documents, "Role")
    bindings = of_kind(documents, "RoleBinding")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    (account,) = of_kind(documents, "ServiceAccount")
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": account["metadata"]["name"],
                "namespace": RELEASE_NAMESPACE,
            }
        ]
    for role in roles:
        resources = {resource for rule in role["rules"] for resource in rule["resources"]}
        assert "clusterkopfpeerings" not in resources


@pytest.mark.timeout(60)
@pytest.mark.parametrize("namespaces", [(), ("team-a",)])
def test_the_operator_may_get_only_the_named_credential_secrets(
    namespaces: tuple[str, ...],
) -> None:
    served = [f"operator.namespaces={{{','.join(namespaces)}}}"] if namespaces else []
    documents = render(*served)
    roles = of_kind(documents, "Role" if namespaces else "ClusterRole")
    assert roles
    for role in roles:
        assert secret_rules(role) == [
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["triton-repository-credential"],
                "verbs": ["get"],
            }
        ]
    none = render(*served, "repositoryCredentials.secretNames=null")
    for role in of_kind(none, "Role" if namespaces else "ClusterRole"):
        assert secret_rules(role) == []


@pytest.mark.timeout(60)
def test_the_sidecar_network_policy_admits_only_the_operator_and_prometheus() -> None:
    documents = render("operator.namespaces={team-a}")  # on by default
    (policy,) = [
        p for p in of_kind(documents, "NetworkPolicy") if p["metadata"]["name"].endswith("sidecars")
    ]
    assert policy["metadata"]["namespace"] == "team-a"
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "triton"}}
    serving, restricted = policy["spec"]["ingress"]
    assert "from" not in serving  # inference stays open to every client
    assert [port["port"] for port in serving["ports"]] == [8000, 8001]
    assert [port["port"] for port in restricted["ports"]] == [9400, 8002]
    (deployment,) = of_kind(documents, "Deployment")
    operator_labels = deployment["spec"]["selector"]["matchLabels"]
    operator, prometheus = restricted["from"]
    assert operator == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}},
        "podSelector": {"matchLabels": operator_labels},
    }
    assert prometheus["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}


@pytest.mark.timeout(60)
def test_the_sidecar_network_policy_needs_the_triton_namespaces() -> None:
    """Without them none is rendered (the install notes say so), and the install still works."""
    documents = render()
    assert [p["metadata"]["name"] for p in of_kind(documents, "NetworkPolicy")] == [
        "batchpilot-operator"
    ]
    given = render("sidecarNetworkPolicy.namespaces={team-a,team-b}")
    sidecars = [p for p in of_kind(given, "NetworkPolicy") if p["metadata"]["name"].endswith("s")]
    assert [p["metadata"]["namespace"] for p in sidecars] == ["team-a", "team-b"]


@pytest.mark.timeout(60)
def test_the_operator_may_reach_only_the_api_server_dns_and_batchpilot_s_ports_on_pods() -> None:
    """Issue 39: a policy's port or Prometheus URL elsewhere (another port of a Pod, an
    address outside the cluster) gets no connection where NetworkPolicies are enforced."""
    (policy,) = of_kind(render(), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    api_server, dns, pods = policy["spec"]["egress"]
    assert "to" not in api_server
    assert [port["port"] for port in api_server["ports"]] == [443, 6443]
    assert dns["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}
    ]
    assert pods["to"] == [{"namespaceSelector": {}}]
    assert [port["port"] for port in pods["ports"]] == [8000, 8002, 9400, 9090]
    (opened,) = of_kind(render("networkPolicy.egress=null"), "NetworkPolicy")
    assert opened["spec"]["policyTypes"] == ["Ingress"]


@pytest.mark.timeout(60)
def test_an_admission_policy_narrows_the_operator_s_pod_status_writes_to_gated_pods() -> None:
    """Issue 39: RBAC gave the operator pods/status of every Pod, kube-system's included."""
    documents = render()
    (policy,) = of_kind(documents, "ValidatingAdmissionPolicy")
    (binding,) = of_kind(documents, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods/status"]
    (who,) = policy["spec"]["matchConditions"]
    account = f"system:serviceaccount:{RELEASE_NAMESPACE}:batchpilot-operator"
    assert who["expression"] == f'request.userInfo.username == "{account}"'
    (check,) = policy["spec"]["validations"]
    assert "batchpilot.dev/config-applied" in check["expression"]
    assert of_kind(render("rbac.podStatusPolicy=false"), "ValidatingAdmissionPolicy") == []


def dcgm_services(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        service
        for service in of_kind(documents, "Service")
        if service["metadata"]["labels"].get("app.kubernetes.io/component")
        == "dcgm-exporter-node-local"
    ]


@pytest.mark.timeout(60)
def test_the_sidecars_reach_the_dcgm_exporter_of_their_own_node() -> None:
    (service,) = dcgm_services(render("dcgmExporter.nodeLocalService.onlyIfNamespaceExists=false"))
    assert service["metadata"] == service["metadata"] | {
        "name": "batchpilot-dcgm-exporter",
        "namespace": "gpu-operator",
    }
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["spec"]["selector"] == {"app": "nvidia-dcgm-exporter"}
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}
    ]


@pytest.mark.timeout(60)
def test_without_the_exporters_namespace_the_service_is_left_out() -> None:
    # `helm template` sees no cluster, as an install sees no gpu-operator namespace.
    assert dcgm_services(render()) == []
    disabled = render(
        "dcgmExporter.nodeLocalService.enabled=false",
        "dcgmExporter.nodeLocalService.onlyIfNamespaceExists=false",
    )
    assert dcgm_services(disabled) == []


def operator_container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = of_kind(documents, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


@pytest.mark.timeout(60)
def test_the_webhook_is_asked_only_about_opted_in_pods_outside_the_release_s_namespace() -> None:
    documents = render("operator.namespaces={team-a,team-b}")
    (configuration,) = of_kind(documents, "MutatingWebhookConfiguration")
    (webhook,) = configuration["webhooks"]
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["timeoutSeconds"] <= 3
    assert webhook["sideEffects"] == "None"
    assert webhook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert webhook["objectSelector"] == {"matchLabels": {"batchpilot.dev/inject": "true"}}
    assert webhook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [RELEASE_NAMESPACE]},
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]},
    ]
    service = webhook["clientConfig"]["service"]
    (served,) = [
        s for s in of_kind(documents, "Service") if s["metadata"]["name"] == service["name"]
    ]
    assert served["spec"]["ports"][0]["targetPort"] == "webhook"
    (secret,) = [
        s for s in of_kind(documents, "Secret") if s["metadata"]["name"] == service["name"]
    ]
    assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    container = operator_container(documents)
    assert "--sidecar-image=batchpilot-sidecar:0.1.0" in container["args"]
    assert "--webhook-certificates=/etc/batchpilot/webhook" in container["args"]
    # The operator needs no right on webhook configurations: the chart owns this one.
    for role in of_kind(documents, "Role") + of_kind(documents, "ClusterRole"):
        assert all("admissionregistration.k8s.io" not in r["apiGroups"] for r in role["rules"])


@pytest.mark.timeout(60)
def test_with_cert_manager_installed_it_makes_the_webhook_s_certificate() -> None:
    arguments = ["--api-versions", "cert-manager.io/v1"]
    manifest = charts.template(*arguments, namespace=RELEASE_NAMESPACE)
    documents = [document for document in yaml.safe_load_all(manifest) if document]
    (configuration,) = of_kind(documents, "MutatingWebhookConfiguration")
    (certificate,) = of_kind(documents, "Certificate")
    annotation = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{RELEASE_NAMESPACE}/{certificate['metadata']['name']}"
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]
    assert not [s for s in of_kind(documents, "Secret") if s["metadata"]["name"] == annotation]


@pytest.mark.timeout(60)
def test_without_the_webhook_nothing_of_it_is_rendered() -> None:
    documents = render("webhook.enabled=false")
    assert of_kind(documents, "MutatingWebhookConfiguration") == []
    assert not any("webhook" in argument for argument in operator_container(documents)["args"])


@pytest.mark.timeout(60)
def test_an_upgrade_that_reuses_values_without_the_webhook_s_keys_renders_without_it() -> None:
    # `helm upgrade --reuse-values` from a chart before the webhook: no webhook, no sidecar key.
    documents = render("webhook=null", "sidecar=null")
    assert of_kind(documents, "MutatingWebhookConfiguration") == []
    assert of_kind(documents, "Deployment")


@pytest.mark.timeout(60)
def test_the_chart_s_own_certificate_serves_the_webhook_s_service_name() -> None:
    documents = render()
    (configuration,) = of_kind(documents, "MutatingWebhookConfiguration")
    service = configuration["webhooks"][0]["clientConfig"]["service"]
    (secret,) = [
        s for s in of_kind(documents, "Secret") if s["metadata"]["name"] == service["name"]
    ]
    pem = {key: base64.b64decode(value) for key, value in secret["data"].items()}
    ca = x509.load_pem_x509_certificate(pem["ca.crt"])
    served = x509.load_pem_x509_certificate(pem["tls.crt"])
    served.verify_directly_issued_by(ca)
    names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    host = f"{service['name']}.{service['namespace']}.svc"
    assert host in names.get_values_for_type(x509.DNSName)
    key = serialization.load_pem_private_key(pem["tls.key"], password=None)
    assert key.public_key().public_numbers() == served.public_key().public_numbers()  # type: ignore[union-attr]
    assert (
        base64.b64decode(configuration["webhooks"][0]["clientConfig"]["caBundle"]) == pem["ca.crt"]
    )
