"""The Helm chart and the plain manifests on a real API server.

Monitoring objects (ServiceMonitor, PodMonitor, PrometheusRule) are checked against the real
Prometheus Operator CRDs, fetched from its pinned Go module and installed here, so the API server
validates them by their real schemas rather than being skipped. kwok fakes the operator Pods that
the chart's Deployment makes (nothing runs in them), so the operator runs here as a process,
authenticated as the chart's ServiceAccount, and must do its work with the chart's RBAC and
peering object alone.
"""

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_testbed import charts, fleet, operators, waiting
from batchpilot_testbed.kubes import Kube

pytestmark = pytest.mark.e2e

EVERY_TOGGLE = (
    "--set", "serviceMonitor.enabled=true",
    "--set", "sidecarPodMonitor.enabled=true",
    "--set", "prometheusRule.enabled=true",
    "--set", "grafana.dashboard.enabled=true",
    "--set", "grafana.alerts.enabled=true",
    "--set", "networkPolicy.enabled=true",
    # Needs operator.namespaces, which every rendering with these toggles sets.
    "--set", "sidecarNetworkPolicy.enabled=true",
)  # fmt: skip

ONE_PLAIN_REPLICA = (
    "--set", "replicaCount=1",
    "--set", "operator.peering.enabled=false",
    "--set", "rbac.create=false",
    "--set", "serviceAccount.create=false",
    "--set", "serviceAccount.name=existing",
)  # fmt: skip


@pytest.fixture(scope="module")
def api(kube: Kube) -> Kube:
    """batchpilot's CRDs and the Prometheus Operator's monitoring CRDs, Established."""
    operators.install_api(kube)
    for path in charts.monitoring_crds():
        applied = kube.kubectl_run(
            "apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=60
        )
        assert applied.returncode == 0, applied.stderr
    waited = kube.kubectl_run(
        "wait", "--for=condition=Established", "--timeout=30s", "crd", "--all"
    )
    assert waited.returncode == 0, waited.stderr
    return kube


def dry_run(kube: Kube, manifest: str, *args: str) -> str:
    applied = kube.kubectl_run("apply", "--dry-run=server", *args, "-f", "-", stdin=manifest)
    assert applied.returncode == 0, applied.stderr
    return applied.stdout


@pytest.mark.timeout(60)
def test_helm_lint_is_clean() -> None:
    linted = charts.helm("lint", "--strict", str(charts.CHART))
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert "[WARNING]" not in linted.stdout
    assert "[ERROR]" not in linted.stdout


@pytest.mark.timeout(60)
def test_unknown_values_are_refused() -> None:
    for wrong in ("replicas=2", "image.tag2=x", "grafana.dashboard.label=x"):
        rendered = charts.helm("template", "x", str(charts.CHART), "--set", wrong)
        assert rendered.returncode != 0, wrong
        assert "additional properties" in rendered.stderr, rendered.stderr


@pytest.mark.timeout(90)
def test_every_rendering_passes_a_server_side_dry_run(api: Kube, namespace: str) -> None:
    renderings = {
        "defaults": charts.template(namespace=namespace),
        "every toggle, one namespace": charts.template(
            *EVERY_TOGGLE, "--set", f"operator.namespaces={{{namespace}}}", namespace=namespace
        ),
        "one plain replica": charts.template(*ONE_PLAIN_REPLICA, namespace=namespace),
    }
    for name, manifest in renderings.items():
        kinds = {document["kind"] for document in yaml.safe_load_all(manifest) if document}
        out = dry_run(api, manifest)
        assert "(server dry run)" in out, name
        assert "Deployment" in kinds, name
    every = renderings["every toggle, one namespace"]
    kinds = {document["kind"] for document in yaml.safe_load_all(every) if document}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "NetworkPolicy"} <= kinds
    assert "KopfPeering" in kinds
    assert "ClusterKopfPeering" not in kinds
    # Serving one namespace: Roles there, nothing cluster-wide; the sidecars' NetworkPolicy
    # there too (no enforcer runs on this cluster: the API server's acceptance is what is
    # tested here, its effect is not).
    assert {"Role", "RoleBinding"} <= kinds
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    policies = [d for d in yaml.safe_load_all(every) if d and d["kind"] == "NetworkPolicy"]
    assert {p["metadata"].get("namespace") for p in policies} == {namespace}
    assert len(policies) == 2


@pytest.mark.timeout(90)
def test_plain_manifests_apply_and_the_samples_are_accepted(api: Kube, namespace: str) -> None:
    install = charts.INSTALL.read_text()
    assert "(server dry run)" in dry_run(api, install)
    triton = (charts.REPO / "manifests" / "triton-deployment.yaml").read_text()
    created = dry_run(api, triton, "-n", namespace)
    assert "deployment.apps/triton created (server dry run)" in created
    # The sample policies for real: the API server's schema and CEL rules accept them.
    applied = api.kubectl_run(
        "apply", "-n", namespace, "-f", str(charts.REPO / "manifests" / "policies")
    )
    assert applied.returncode == 0, applied.stderr
    listed = api.kubectl_run("get", "bp", "-n", namespace, "-o", "name")
    assert sorted(listed.stdout.split()) == [
        "batchpolicy.batchpilot.dev/llm-market-hours",
        "batchpolicy.batchpilot.dev/load-based",
        "batchpolicy.batchpilot.dev/market-hours",
        "batchpolicy.batchpilot.dev/slo-autotune",
    ]


@dataclasses.dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    """Where the chart is installed: it enforces the restricted Pod Security Standard."""


@pytest.fixture
def release(api: Kube, namespace: str) -> Iterator[Release]:
    """The chart installed, every toggle on, serving the test's namespace from a namespace of its
    own; uninstalled at the end (its cluster-scoped RBAC with it)."""
    name = f"batchpilot-{uuid.uuid4().hex[:6]}"
    home = f"{namespace}-sys"
    # The Deployment's Pods are admitted only if the chart's security contexts satisfy the
    # restricted standard (the test's Triton Pods, next door, need not).
    created = api.kubectl_run("create", "namespace", home)
    assert created.returncode == 0, created.stderr
    labelled = api.kubectl_run(
        "label", "namespace", home,
        "pod-security.kubernetes.io/enforce=restricted", "batchpilot.dev/e2e=1",
    )  # fmt: skip
    assert labelled.returncode == 0, labelled.stderr
    helm = ("--kubeconfig", str(api.kubeconfig), "--kube-context", api.context, "-n", home)
    try:
        installed = charts.helm(
            "install", name, str(charts.CHART), *helm,
            "--set", f"operator.namespaces={{{namespace}}}",
            *EVERY_TOGGLE,
            "--wait", "--timeout", "60s",
            timeout=90,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stdout + installed.stderr
        assert f"serving namespaces {namespace}" in installed.stdout  # NOTES.txt
        yield Release(name, home)
        uninstalled = charts.helm("uninstall", name, *helm, "--wait", "--timeout", "30s")
        assert uninstalled.returncode == 0, uninstalled.stderr
    finally:
        api.kubectl_run("delete", "namespace", home, "--wait=false")


def switch_policy(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "metadata": {"name": name},
        "spec": {
            "target": {
                "selector": {"matchLabels": {"app.kubernetes.io/name": "triton"}},
                "port": "http",
                "models": [fleet.MODEL],
            },
            "profiles": {
                "interactive": {"maxQueueDelayMicroseconds": 2000, "preferredBatchSizes": [4, 8]},
                "bulk": {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]},
            },
            "defaultProfile": "bulk",
            "minDwellSeconds": 0,
            **spec,
        },
    }


@pytest.mark.timeout(150)
def test_operator_with_the_chart_s_rbac_switches_a_real_triton(
    api: Kube,
    namespace: str,
    release: Release,
    local_cluster: object,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    operator_name = f"{release.name}-operator"
    rolled_out = api.apps.read_namespaced_deployment(operator_name, release.namespace).status
    assert rolled_out is not None
    assert rolled_out.ready_replicas == 2, "restricted Pod Security refused the Pods"
    kubeconfig = operators.service_account_kubeconfig(
        api, tmp_path / "kubeconfig", service_account=operator_name, namespace=release.namespace
    )
    operator = operators.OperatorProcess(
        kubeconfig=kubeconfig,
        log_path=tmp_path / "operator.log",
        namespaces=[namespace],
        standalone=False,
        extra=["--peering", release.name],
    )
    request.node.operator_logs = [operator.log_path]
    try:
        waiting.wait_for("the operator's liveness endpoint", operator.healthy, timeout=30)
        ips = fleet.start_tritons(
            api, namespace, 1, gated=True, labels={"app.kubernetes.io/name": "triton"}
        )
        (pod,) = ips
        (ip,) = ips.values()
        operators.apply_policy(api, namespace, switch_policy("desk"))
        waiting.wait_for("bulk served", lambda: fleet.served_profile(ip) == "bulk", timeout=60)
        waiting.wait_for(
            "the readiness gate opened",
            lambda: fleet.gate_open(api, namespace, pod),
            timeout=30,
        )
        operators.apply_policy(
            api, namespace, switch_policy("desk", override={"profile": "interactive"})
        )
        waiting.wait_for(
            "interactive served", lambda: fleet.served_profile(ip) == "interactive", timeout=60
        )

        def interactive_status() -> dict[str, Any] | None:
            status = operators.policy_status(api, namespace, "desk")
            return status if status.get("activeProfile") == "interactive" else None

        status = waiting.wait_for("the status written", interactive_status, timeout=30)
        assert status["targets"]["summary"] == "1/1 updated"
        assert any(
            "bulk -> interactive" in message
            for message in operators.events(api, namespace, "ProfileSwitched")
        )
        peering = api.kubectl_run("get", "kopfpeering", release.name, "-n", namespace, "-o", "yaml")
        assert peering.returncode == 0, peering.stderr
        assert yaml.safe_load(peering.stdout).get("status") or {}, "the operator never joined"
        assert "Forbidden" not in operator.log
    finally:
        # While the operator runs, so that it opens the gates the policy held.
        api.kubectl_run("delete", "bp", "--all", "-n", namespace, "--timeout=20s")
        operator.stop()
