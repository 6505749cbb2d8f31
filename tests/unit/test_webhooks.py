"""The webhook's handler as kopf serves it: an AdmissionReview in, the review kopf answers out.

kopf's admission engine is called as its webhook server calls it (`serve_admission_request`,
kopf's internals, the boundary faked here); e2e/test_joining.py has a real API server call the
real server."""

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import jsonpatch
import kopf
import pytest
import yaml
from kopf._cogs.structs import ephemera, ids, references, reviews
from kopf._core.engines import admission
from kopf._core.reactor import inventory

from batchpilot.admission import injections, webhooks
from batchpilot.api import names

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "triton-deployment.yaml"
PODS = references.Resource(group="", version="v1", plural="pods", kind="Pod", namespaced=True)
OPTIONS = webhooks.WebhookOptions(
    host="127.0.0.1",
    port=9443,
    certificates=Path("/nonexistent"),
    injection=injections.Settings(sidecar_image="sidecar:1", operator_namespace="bp-system"),
)


def plain_pod(**annotations: str) -> dict[str, Any]:
    documents = yaml.safe_load_all(MANIFEST.read_text())
    (deployment,) = [d for d in documents if d and d["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    labels = {"app.kubernetes.io/name": "triton", names.INJECT_LABEL: names.INJECT_VALUE}
    (triton,) = [c for c in template["spec"]["containers"] if c["name"] == "triton"]
    triton["args"] = [a for a in triton["args"] if "restricted" not in a]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "triton-", "namespace": "serving", "labels": labels}
        | ({"annotations": annotations} if annotations else {}),
        "spec": {"containers": [triton]},
    }


def review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
        },
    }


def answer(pod: dict[str, Any]) -> dict[str, Any]:
    registry = kopf.OperatorRegistry()
    webhooks.register(registry, OPTIONS)
    insights = references.Insights()
    insights.webhook_resources.add(PODS)

    async def serve() -> dict[str, Any]:
        response = await admission.serve_admission_request(
            reviews.Request(review(pod)),  # type: ignore[misc]
            webhook=ids.HandlerId(webhooks.HANDLER_ID),
            settings=kopf.OperatorSettings(),
            memories=inventory.ResourceMemories(),
            memobase=ephemera.AnyMemo(kopf.Memo()),
            registry=registry,
            insights=insights,
            indices=kopf.Memo(),
        )
        return dict(response["response"])

    return asyncio.run(serve())


@pytest.mark.timeout(30)
def test_kopf_answers_with_the_injections_patch() -> None:
    pod = plain_pod()
    response = answer(pod)
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    expected = injections.inject(pod, OPTIONS.injection, namespace="serving").pod
    assert jsonpatch.apply_patch(pod, patch) == expected


@pytest.mark.timeout(30)
def test_a_refusal_denies_the_pod_with_its_reason() -> None:
    response = answer(plain_pod(**{names.TRITON_FLAGS_ANNOTATION: "jit"}))
    assert response["allowed"] is False
    assert response["status"]["code"] == 400
    assert "unknown 'jit'" in response["status"]["message"]
    assert "patch" not in response


@pytest.mark.timeout(30)
def test_pods_of_the_operators_namespace_are_admitted_unchanged() -> None:
    pod = plain_pod()
    pod["metadata"]["namespace"] = "bp-system"
    response = answer(pod)
    assert response["allowed"] is True
    assert "patch" not in response
