"""The pod runner's rules: which pods it runs, and that annotations never become commands."""

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from batchpilot_harness import local_triton
from e2e.cluster import podrunner

NODES = ("kwok-node-0",)
NETWORKS = (ipaddress.ip_network("10.88.0.0/24"),)


def pod(**overrides: Any) -> dict[str, Any]:
    annotations = {podrunner.RUNTIME_ANNOTATION: "triton", podrunner.MODELS_ANNOTATION: "gpu_sim"}
    annotations.update(overrides.pop("annotations", {}))
    body: dict[str, Any] = {
        "metadata": {"uid": "u1", "namespace": "ns", "name": "p", "annotations": annotations},
        "spec": {"nodeName": "kwok-node-0"},
        "status": {"phase": "Running", "podIP": "10.88.0.7"},
    }
    for path, value in overrides.items():
        section, key = path.split("__")
        body[section][key] = value
    return body


def request(body: dict[str, Any]) -> podrunner.PodRequest | None:
    return podrunner.pod_request(body, nodes=NODES, networks=NETWORKS)


def test_annotated_running_pod_with_an_ip_is_run() -> None:
    assert request(pod()) == podrunner.PodRequest(
        uid="u1",
        namespace="ns",
        name="p",
        ip="10.88.0.7",
        runtime="triton",
        models=("gpu_sim",),
        grace_seconds=podrunner.STOP_TIMEOUT,
    )


@pytest.mark.parametrize(
    "body",
    [
        pod(annotations={podrunner.RUNTIME_ANNOTATION: None}),
        pod(spec__nodeName="real-node"),
        pod(status__podIP=None),
        pod(status__phase="Succeeded"),
        pod(metadata__deletionTimestamp="2026-01-01T00:00:00Z"),
    ],
    ids=["not-annotated", "other-node", "no-ip-yet", "finished", "deleting"],
)
def test_pods_that_are_not_ours_or_not_running_are_left_alone(body: dict[str, Any]) -> None:
    body["metadata"]["annotations"] = {
        k: v for k, v in body["metadata"]["annotations"].items() if v is not None
    }
    assert request(body) is None


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (pod(annotations={podrunner.RUNTIME_ANNOTATION: "sh -c id"}), "unknown runtime"),
        (pod(annotations={podrunner.MODELS_ANNOTATION: "gpu_sim,--help"}), "not a model name"),
        (pod(annotations={podrunner.MODELS_ANNOTATION: "../etc"}), "not a model name"),
        (pod(annotations={podrunner.MODELS_ANNOTATION: "a b"}), "not a model name"),
        (pod(annotations={podrunner.MODELS_ANNOTATION: ",".join("m" * 10)}), "more than"),
        (pod(status__podIP="127.0.0.1"), "outside the pod CIDRs"),
        (pod(status__podIP="192.0.2.2"), "outside the pod CIDRs"),
        (pod(spec__hostNetwork=True), "hostNetwork"),
        (pod(annotations={podrunner.GRPC_AGE_ANNOTATION: "1e3"}), "not 100 to 600000"),
        (pod(annotations={podrunner.GRPC_AGE_ANNOTATION: "50"}), "not 100 to 600000"),
        (pod(annotations={podrunner.GRPC_AGE_ANNOTATION: "1000 --x"}), "not 100 to 600000"),
    ],
    ids=[
        "runtime",
        "flag",
        "path",
        "space",
        "too-many",
        "loopback",
        "host-ip",
        "host-network",
        "age-float",
        "age-short",
        "age-flag",
    ],
)
def test_pods_asking_for_anything_else_are_rejected(body: dict[str, Any], reason: str) -> None:
    with pytest.raises(podrunner.RejectedPod, match=reason):
        request(body)


def test_triton_argv_is_built_from_the_table_with_one_flag_per_model(tmp_path: Path) -> None:
    req = request(pod(annotations={podrunner.MODELS_ANNOTATION: "gpu_sim, other-1"}))
    assert req is not None
    triton, sidecar = podrunner.RUNTIMES["triton"](req, podrunner.Workspace(directory=tmp_path))
    argv = list(triton.argv)
    # In the pod's own network namespace, on every address, as in a container.
    assert argv[1:5] == ["-m", "batchpilot_harness.local_triton", "--host", "0.0.0.0"]
    assert argv[-4:] == ["--model", "gpu_sim", "--model", "other-1"]
    assert str(podrunner.MODEL_REPOSITORY) in argv
    assert sidecar.container == "batchpilot-sidecar"
    assert list(sidecar.argv[1:7]) == [
        "-m",
        "batchpilot_sidecar",
        "--triton-url",
        "http://127.0.0.1:8000",
        "--listen",
        "0.0.0.0:9400",
    ]


def test_http_echo_serves_the_pod_name_from_its_own_folder(tmp_path: Path) -> None:
    req = request(pod(annotations={podrunner.RUNTIME_ANNOTATION: "http-echo"}))
    assert req is not None
    (command,) = podrunner.RUNTIMES["http-echo"](req, podrunner.Workspace(directory=tmp_path))
    assert command.argv[command.argv.index("--bind") + 1] == "0.0.0.0"
    assert (tmp_path / "www" / "index.html").read_text() == "ns/p\n"


def test_the_hostile_runtime_runs_only_its_own_servers_on_every_address(tmp_path: Path) -> None:
    req = request(
        pod(annotations={podrunner.RUNTIME_ANNOTATION: "hostile", podrunner.MODELS_ANNOTATION: "x"})
    )
    assert req is not None
    (command,) = podrunner.RUNTIMES["hostile"](req, podrunner.Workspace(directory=tmp_path))
    assert command.argv[1:] == ("-m", "e2e.hostile_servers", "--host", "0.0.0.0")


def test_a_grpc_connection_age_runs_triton_with_that_flag(tmp_path: Path) -> None:
    req = request(pod(annotations={podrunner.GRPC_AGE_ANNOTATION: "1500"}))
    assert req is not None
    assert req.grpc_max_connection_age_ms == 1500
    triton, _ = podrunner.RUNTIMES["triton"](req, podrunner.Workspace(directory=tmp_path))
    assert triton.argv[1:3] == ("-m", "batchpilot_harness.local_triton")
    assert triton.argv[-2:] == ("--grpc-max-connection-age-ms", "1500")
    assert local_triton.grpc_age_arguments(1500) == [
        "--grpc-max-connection-age=1500",
        "--grpc-max-connection-age-grace=1500",
    ]
    assert local_triton.grpc_age_arguments(None) == []


def test_a_locked_repository_runs_triton_with_the_header_and_the_secrets_value(
    tmp_path: Path,
) -> None:
    reference = {"secretKeyRef": {"name": "triton-repository-credential", "key": "token"}}
    containers = [
        {"name": "triton", "env": [{"name": "TRITON_REPOSITORY_TOKEN", "valueFrom": reference}]}
    ]
    body = pod(annotations={podrunner.REPOSITORY_HEADER_ANNOTATION: "batchpilot-repository-token"})
    body["spec"]["containers"] = containers
    req = request(body)
    assert req is not None
    assert req.repository_secret == ("triton-repository-credential", "token")
    triton, sidecar = podrunner.RUNTIMES["triton"](req, podrunner.Workspace(directory=tmp_path))
    assert triton.argv[-2:] == ("--repository-header", "batchpilot-repository-token")
    # The value never reaches an argv the runner builds: it is read from the Secret at start.
    assert triton.secret_environment == (
        ("TRITON_REPOSITORY_TOKEN", "triton-repository-credential", "token"),
    )
    assert sidecar.secret_environment == ()


@pytest.mark.parametrize(
    ("header", "env", "reason"),
    [
        ("Not A Header", [], "is not a header name"),
        ("batchpilot-repository-token", [], "needs TRITON_REPOSITORY_TOKEN from a secretKeyRef"),
        (
            "batchpilot-repository-token",
            [{"name": "TRITON_REPOSITORY_TOKEN", "value": "in-the-pod-spec"}],
            "needs TRITON_REPOSITORY_TOKEN from a secretKeyRef",
        ),
    ],
)
def test_a_locked_repository_without_a_secret_is_rejected(
    header: str, env: list[dict[str, Any]], reason: str
) -> None:
    body = pod(annotations={podrunner.REPOSITORY_HEADER_ANNOTATION: header})
    body["spec"]["containers"] = [{"name": "triton", "env": env}]
    with pytest.raises(podrunner.RejectedPod, match=reason):
        request(body)
