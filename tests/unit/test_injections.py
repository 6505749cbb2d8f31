"""The admission webhook's injection: an unmodified Triton Pod that opted in becomes the Pod
manifests/triton-deployment.yaml wires by hand; bad asks are refused, saying why."""

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from batchpilot.admission import injections
from batchpilot.api import names

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "triton-deployment.yaml"
SETTINGS = injections.Settings(
    sidecar_image="registry.example/batchpilot-sidecar:0.1.0",
    operator_namespace="batchpilot-system",
    dcgm_url="http://batchpilot-dcgm-exporter.gpu-operator.svc:9400/metrics",
)
HAND_MADE = ("--http-restricted-api", "--grpc-restricted-protocol")


def manifest_pod() -> dict[str, Any]:
    """The example Deployment's Pod, as a Pod the API server would admit."""
    documents = yaml.safe_load_all(MANIFEST.read_text())
    (deployment,) = [d for d in documents if d and d["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(template)}


def users_pod(flags: str = "restricted-api") -> dict[str, Any]:
    """The example's Pod as a user has it before batchpilot: no sidecar, gate, governed label,
    port names, restricted flags or credential; the opt-in label and the annotation instead."""
    pod = manifest_pod()
    labels = pod["metadata"]["labels"]
    del labels[names.GOVERNED_LABEL]
    labels[names.INJECT_LABEL] = names.INJECT_VALUE
    if flags:
        pod["metadata"]["annotations"] = {names.TRITON_FLAGS_ANNOTATION: flags}
    spec = pod["spec"]
    del spec["readinessGates"]
    spec["containers"] = [c for c in spec["containers"] if c["name"] == "triton"]
    (triton,) = spec["containers"]
    triton["args"] = [a for a in triton["args"] if not a.startswith(HAND_MADE)]
    triton["env"] = [e for e in triton["env"] if e["name"] != injections.TOKEN_VARIABLE]
    triton["ports"] = [{"containerPort": p["containerPort"]} for p in triton["ports"]]
    triton["readinessProbe"]["httpGet"]["port"] = 8000
    triton["livenessProbe"]["httpGet"]["port"] = 8000
    triton["startupProbe"]["httpGet"]["port"] = 8000
    return pod


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod["spec"]["containers"] if c["name"] == name]
    (only,) = found
    return only


def test_a_users_triton_pod_gets_what_the_example_deployment_wires_by_hand() -> None:
    injection = injections.inject(users_pod(), SETTINGS, namespace="serving")
    made, example = injection.pod, manifest_pod()
    assert made["metadata"]["labels"][names.GOVERNED_LABEL] == names.GOVERNED_VALUE
    assert made["spec"]["readinessGates"] == example["spec"]["readinessGates"]
    triton, wanted = container(made, "triton"), container(example, "triton")
    assert triton["args"] == wanted["args"]
    assert sorted(triton["env"], key=str) == sorted(wanted["env"], key=str)
    by_number = {p["containerPort"]: p for p in triton["ports"]}
    assert by_number == {p["containerPort"]: p for p in wanted["ports"]}
    sidecar, by_hand = (
        container(made, "batchpilot-sidecar"),
        container(example, "batchpilot-sidecar"),
    )
    assert sidecar["image"] == SETTINGS.sidecar_image
    for key in ("command", "env", "ports", "resources", "securityContext", "volumeMounts"):
        assert sidecar[key] == by_hand[key], key
    # The example's arguments, less the objective of its gauges (the sidecar's default).
    assert set(sidecar["args"]) == set(by_hand["args"]) - {"--slo-p95-ms=50"}
    assert made["metadata"]["annotations"][names.INJECTED_ANNOTATION].startswith("label ")


def test_the_patch_makes_the_pod_it_describes_and_a_second_injection_adds_nothing() -> None:
    pod = users_pod("restricted-api,explicit-model-control,summary-latencies")
    injection = injections.inject(pod, SETTINGS, namespace="serving")
    assert jsonpatch.apply_patch(pod, injection.patch) == injection.pod
    assert pod == users_pod("restricted-api,explicit-model-control,summary-latencies")
    again = injections.inject(injection.pod, SETTINGS, namespace="serving")
    assert again.patch == []


def test_pods_that_did_not_opt_in_or_live_in_the_operators_namespace_are_left_alone() -> None:
    pod = users_pod()
    del pod["metadata"]["labels"][names.INJECT_LABEL]
    assert injections.inject(pod, SETTINGS, namespace="serving").patch == []
    own = injections.inject(users_pod(), SETTINGS, namespace="batchpilot-system")
    assert own.patch == []


def test_explicit_model_control_replaces_the_default_mode_and_loads_every_model() -> None:
    pod = users_pod("explicit-model-control")
    triton = container(pod, "triton")
    triton["args"] = ["--model-repository=/models"]
    made = container(injections.inject(pod, SETTINGS, namespace="x").pod, "triton")
    assert made["args"] == [
        "--model-repository=/models",
        "--model-control-mode=explicit",
        "--load-model=*",
    ]
    triton["args"] = ["--model-repository=/models", "--model-control-mode=none"]
    made = container(injections.inject(pod, SETTINGS, namespace="x").pod, "triton")
    assert made["args"][1:] == ["--model-control-mode=explicit", "--load-model=*"]


def test_ports_the_user_named_stay_theirs_and_unnamed_ones_get_batchpilots_names() -> None:
    pod = users_pod("")
    container(pod, "triton")["ports"] = [
        {"name": "web", "containerPort": 8000},
        {"containerPort": 8002},
    ]
    made = container(injections.inject(pod, SETTINGS, namespace="x").pod, "triton")
    assert made["ports"] == [
        {"name": "web", "containerPort": 8000},
        {"name": "metrics", "containerPort": 8002},
        {"name": "grpc", "containerPort": 8001},
    ]


def test_the_sidecar_reaches_triton_on_the_port_its_flags_name() -> None:
    pod = users_pod("")
    triton = container(pod, "triton")
    triton["args"] = [a for a in triton["args"] if not a.startswith("--http-port")]
    triton["args"].append("--http-port=8080")
    made = injections.inject(pod, SETTINGS, namespace="x").pod
    assert "--triton-url=http://127.0.0.1:8080" in container(made, "batchpilot-sidecar")["args"]
    assert {"name": "http", "containerPort": 8080} in container(made, "triton")["ports"]


def test_the_version_comes_from_an_annotation_where_the_image_does_not_say() -> None:
    pod = users_pod()
    container(pod, "triton")["image"] = "registry.example/our-triton:prod"
    with pytest.raises(injections.Refused, match=names.TRITON_VERSION_ANNOTATION):
        injections.inject(pod, SETTINGS, namespace="x")
    pod["metadata"]["annotations"][names.TRITON_VERSION_ANNOTATION] = "2.51"
    made = injections.inject(pod, SETTINGS, namespace="x").pod
    assert any(a.startswith("--http-restricted-api=") for a in container(made, "triton")["args"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda pod: pod["metadata"]["annotations"].update({names.TRITON_FLAGS_ANNOTATION: "jit"}),
         "unknown 'jit'"),
        (lambda pod: container(pod, "triton").update(
            {"image": "nvcr.io/nvidia/tritonserver:23.12-py3"}), "earlier one"),
        (lambda pod: pod["metadata"]["annotations"].update(
            {names.TRITON_VERSION_ANNOTATION: "2.40"}), "earlier one"),
        (lambda pod: pod["metadata"]["annotations"].update(
            {names.TRITON_VERSION_ANNOTATION: "latest"}), "not a Triton version"),
        (lambda pod: pod["metadata"]["annotations"].update(
            {names.REPOSITORY_CREDENTIAL_ANNOTATION: "Not_A_Name"}), "not a Secret's name"),
        (lambda pod: container(pod, "triton")["args"].append(
            "--http-restricted-api=model-repository:k=v"), "already runs with restricted"),
        (lambda pod: container(pod, "triton").update(
            {"command": ["bash", "-c"], "args": ["tritonserver --model-repository=/models"]}),
         "runs a shell"),
        (lambda pod: container(pod, "triton").update({"command": None, "args": None}),
         "default command"),
        (lambda pod: container(pod, "triton").update({"name": "server", "command": ["serve"]}),
         "no container to govern"),
        (lambda pod: container(pod, "triton")["args"].append("--http-port=http"), "not a port"),
    ],
)  # fmt: skip
def test_what_cannot_be_done_is_refused_saying_why(change: Any, message: str) -> None:
    pod = users_pod()
    change(pod)
    with pytest.raises(injections.Refused, match=message):
        injections.inject(pod, SETTINGS, namespace="x")


def test_a_polling_triton_is_not_switched_to_explicit_mode() -> None:
    pod = users_pod("explicit-model-control")
    triton = container(pod, "triton")
    triton["args"] = [a for a in triton["args"] if not a.startswith("--model-control-mode")]
    triton["args"].append("--model-control-mode=poll")
    with pytest.raises(injections.Refused, match="poll"):
        injections.inject(pod, SETTINGS, namespace="x")


def test_a_model_repository_on_object_storage_is_not_mounted_into_the_sidecar() -> None:
    pod = users_pod("")
    triton = container(pod, "triton")
    triton["args"] = [
        "--model-repository=s3://bucket/models" if a.startswith("--model-repository") else a
        for a in triton["args"]
    ]
    sidecar = container(injections.inject(pod, SETTINGS, namespace="x").pod, "batchpilot-sidecar")
    assert "volumeMounts" not in sidecar
    assert not any(a.startswith("--model-repository") for a in sidecar["args"])
