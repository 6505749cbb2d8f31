"""The plain manifests: sample policies, the plain install and the example Triton Deployment.

`manifests/install.yaml` and `manifests/rbac.yaml` are `helm template` output (`make generate`);
tests/test_generated.py checks that they are current and e2e/test_chart.py applies them to a real
API server. These tests read them as a user's `kubectl apply -f` would, without helm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot.api import documents, names

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
SAMPLES = sorted((MANIFESTS / "policies").glob("*.yaml"))
# Triton's APIs the example locks to the header: the repository's (the operator's) and the
# administrator's (log files, trace settings, shared-memory regions).
LOCKED_APIS = "model-repository,logging,trace,shared-memory"


def documents_of(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def by_kind(path: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for document in documents_of(path):
        found.setdefault(document["kind"], []).append(document)
    return found


def test_the_samples_are_market_hours_load_based_slo_autotune_and_llm() -> None:
    assert [path.name for path in SAMPLES] == [
        "llm-market-hours.yaml",
        "load-based.yaml",
        "market-hours.yaml",
        "slo-autotune.yaml",
    ]
    # One market-hours sample, under both of its names.
    market_hours = MANIFESTS / "policies" / "market-hours.yaml"
    assert market_hours.resolve() == MANIFESTS / "batchpolicy.yaml"


@pytest.mark.parametrize("path", SAMPLES, ids=lambda path: path.stem)
def test_every_sample_policy_is_valid(path: Path) -> None:
    named = documents.parse_yaml_policy(path.read_text(), default_name=path.stem)
    assert named.name == path.stem
    spec = named.spec
    assert spec.default_profile in spec.profiles
    assert spec.target.selector.match_labels == {"app.kubernetes.io/name": "triton"}


def test_a_policy_document_s_namespace_is_read_for_the_runner_s_series() -> None:
    sample = (MANIFESTS / "policies" / "slo-autotune.yaml").read_text()
    assert documents.parse_yaml_policy(sample, default_name="x").namespace == ""
    placed = sample.replace("metadata:\n", "metadata:\n  namespace: serving\n", 1)
    assert documents.parse_yaml_policy(placed, default_name="x").namespace == "serving"


def test_slo_sample_autotunes_interactive_only() -> None:
    spec = documents.parse_yaml_policy(
        (MANIFESTS / "policies" / "slo-autotune.yaml").read_text(), default_name="x"
    ).spec
    assert spec.slo is not None
    assert spec.slo.autotune
    assert spec.slo_governs("interactive")
    assert not spec.slo_governs("bulk")


def test_plain_install_has_namespace_crds_rbac_deployment_and_peering() -> None:
    kinds = by_kind(MANIFESTS / "install.yaml")
    (namespace,) = kinds["Namespace"]
    assert namespace["metadata"]["name"] == "batchpilot-system"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    crds = {crd["metadata"]["name"]: crd for crd in kinds["CustomResourceDefinition"]}
    for path in sorted((REPO / "crds").glob("*.yaml")):
        for crd in documents_of(path):
            assert crds.pop(crd["metadata"]["name"]) == crd, path
    assert crds == {}
    (peering,) = kinds["ClusterKopfPeering"]
    (deployment,) = kinds["Deployment"]
    assert deployment["metadata"]["namespace"] == "batchpilot-system"
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert f"--peering={peering['metadata']['name']}" in container["args"]
    assert "--standalone" not in container["args"]
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service"):
        assert len(kinds[kind]) == 1, kind


def test_plain_install_runs_under_the_restricted_pod_security_standard() -> None:
    (deployment,) = by_kind(MANIFESTS / "install.yaml")["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": 9402, "healthz": 8080}
    assert "--metrics-listen=0.0.0.0:9402" in container["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]


def test_rbac_manifest_is_the_install_s_rbac() -> None:
    install = by_kind(MANIFESTS / "install.yaml")
    rbac = by_kind(MANIFESTS / "rbac.yaml")
    assert set(rbac) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    for kind, objects in rbac.items():
        assert objects == install[kind], kind
    (role,) = rbac["ClusterRole"]
    verbs = {
        (group, resource): tuple(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    # Least privilege: nothing creates, deletes or updates objects but events.
    assert {verb for granted in verbs.values() for verb in granted} <= {
        "get",
        "list",
        "watch",
        "patch",
        "create",
    }
    assert [key for key, granted in verbs.items() if "create" in granted] == [("", "events")]
    # Secrets: only `get`, only the credential Secrets by name, never list or watch.
    (secrets,) = [rule for rule in role["rules"] if "secrets" in rule["resources"]]
    assert secrets["verbs"] == ["get"]
    assert secrets["resourceNames"] == ["triton-repository-credential"]


def test_triton_example_is_governable() -> None:
    kinds = by_kind(MANIFESTS / "triton-deployment.yaml")
    (deployment,) = kinds["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["readinessGates"] == [{"conditionType": "batchpilot.dev/config-applied"}]
    containers = {container["name"]: container for container in pod["containers"]}
    triton = containers["triton"]
    assert "--model-control-mode=explicit" in triton["args"]
    assert "--metrics-config=summary_latencies=true" in triton["args"]
    ports = {
        port["name"]: port["containerPort"]
        for container in containers.values()
        for port in container["ports"]
    }
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "sidecar": 9400}
    # The sidecar reads Triton's repository, read-only, to serve vLLM models' model.json.
    sidecar = containers["batchpilot-sidecar"]
    (repository,) = [arg for arg in triton["args"] if arg.startswith("--model-repository=")]
    mount = repository.removeprefix("--model-repository=")
    assert f"--model-repository={mount}" in sidecar["args"]
    assert sidecar["volumeMounts"] == [
        {"name": mounted["name"], "mountPath": mount, "readOnly": True}
        for mounted in triton["volumeMounts"]
        if mounted["mountPath"] == mount
    ]
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    # The sample policies select these Pods by the label the Deployment gives them, among the
    # Pods that carry the opt-in label the operator's watch selects.
    assert deployment["spec"]["template"]["metadata"]["labels"] == {
        "app.kubernetes.io/name": "triton",
        names.GOVERNED_LABEL: names.GOVERNED_VALUE,
    }
    (service,) = kinds["Service"]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "triton"}


def test_triton_example_locks_its_model_repository_api_to_the_policies_credential() -> None:
    (deployment,) = by_kind(MANIFESTS / "triton-deployment.yaml")["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (triton,) = [c for c in pod["containers"] if c["name"] == "triton"]
    (token,) = [variable for variable in triton["env"] if "valueFrom" in variable]
    reference = token["valueFrom"]["secretKeyRef"]
    for path in SAMPLES:
        credential = documents.parse_yaml_policy(path.read_text(), default_name="x").spec.target
        assert credential.repository_credential is not None, path
        named = credential.repository_credential
        assert (named.secret_name, named.key) == (reference["name"], reference["key"]), path
        value = f"{named.header}=$({token['name']})"
        # HTTP and gRPC alike: either would otherwise load a model with its own model.py.
        locked = f"{LOCKED_APIS}:{value}"
        assert f"--http-restricted-api={locked}" in triton["args"]
        assert f"--grpc-restricted-protocol={locked}" in triton["args"]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("container", ["triton", "batchpilot-sidecar"])
def test_triton_example_containers_run_restricted(container: str) -> None:
    (deployment,) = by_kind(MANIFESTS / "triton-deployment.yaml")["Deployment"]
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container
    ]
    security = found["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
