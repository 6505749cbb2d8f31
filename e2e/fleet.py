"""Real Triton servers behind real Pods, for e2e tests: run by the local cluster's pod runner, or,
on kind, by the kubelet from the images that `python -m e2e.kind up` built."""

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes import client

from batchpilot.kube import pods
from batchpilot_triton import endpoints, modelconfigs
from e2e import waiting
from e2e.cluster import podrunner
from e2e.kubes import Kube

MODEL = "gpu_sim"
PROFILES: dict[str, dict[str, Any]] = {
    "interactive": {"maxQueueDelayMicroseconds": 2000, "preferredBatchSizes": [4, 8]},
    "bulk": {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]},
}
"""The two profiles that the e2e policies and the benchmarks switch between."""
QUEUE_DELAY = {name: profile["maxQueueDelayMicroseconds"] for name, profile in PROFILES.items()}


# Set by `python -m e2e.kind test`: the images of real Triton Pods on kind.
TRITON_IMAGE_ENV = "BATCHPILOT_E2E_TRITON_IMAGE"
SIDECAR_IMAGE_ENV = "BATCHPILOT_E2E_SIDECAR_IMAGE"
# Where the local pod runner runs the processes, kwok never pulls these.
UNPULLED_TRITON = "registry.invalid/batchpilot/tritonserver:0"
UNPULLED_SIDECAR = "registry.invalid/batchpilot/sidecar:0"


def pods_run_here(local: bool) -> bool:
    """Whether Triton Pods really run on this cluster: the local one, or kind with images."""
    return local or bool(os.environ.get(TRITON_IMAGE_ENV))


def triton_url(ip: str) -> str:
    """Where the Triton of the Pod at `ip` serves HTTP."""
    return f"http://{ip}:{endpoints.TRITON_HTTP_PORT}"


def sidecar_url(ip: str) -> str:
    return f"http://{ip}:{endpoints.SIDECAR_PORT}"


def triton_pod(
    name: str, *, labels: dict[str, str], gated: bool, models: Sequence[str] = (MODEL,)
) -> client.V1Pod:
    triton = client.V1Container(
        name="triton",
        image=os.environ.get(TRITON_IMAGE_ENV, UNPULLED_TRITON),
        image_pull_policy="Never",
        args=[argument for model in models for argument in ("--model", model)],
        ports=[
            client.V1ContainerPort(name="http", container_port=endpoints.TRITON_HTTP_PORT),
            client.V1ContainerPort(name="metrics", container_port=endpoints.TRITON_METRICS_PORT),
        ],
    )
    sidecar = client.V1Container(
        name="batchpilot-sidecar",
        image=os.environ.get(SIDECAR_IMAGE_ENV, UNPULLED_SIDECAR),
        image_pull_policy="Never",
        args=[
            f"--triton-url={triton_url('127.0.0.1')}",
            f"--listen={endpoints.EVERY_ADDRESS}:{endpoints.SIDECAR_PORT}",
            "--rate-window=5",
        ],
        ports=[client.V1ContainerPort(name="sidecar", container_port=endpoints.SIDECAR_PORT)],
    )
    gates = [client.V1PodReadinessGate(condition_type=pods.GATE)] if gated else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            labels=labels,
            annotations={
                podrunner.RUNTIME_ANNOTATION: "triton",
                podrunner.MODELS_ANNOTATION: ",".join(models),
            },
        ),
        spec=client.V1PodSpec(
            containers=[triton, sidecar],
            readiness_gates=gates,
            termination_grace_period_seconds=5,
        ),
    )


def http_json(url: str, *, timeout: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def triton_ready(ip: str) -> bool:
    """Triton serves, and so does the sidecar beside it."""
    return answers(f"{triton_url(ip)}/v2/health/ready") and answers(f"{sidecar_url(ip)}/healthz")


def start_tritons(
    kube: Kube,
    namespace: str,
    count: int,
    *,
    gated: bool = False,
    labels: dict[str, str] | None = None,
    prefix: str = "triton",
) -> dict[str, str]:
    """Create `count` Triton Pods and wait until each serves; their IPs by name."""
    labels = labels or {"app": "triton"}
    names = [f"{prefix}-{index}" for index in range(count)]
    for name in names:
        kube.core.create_namespaced_pod(namespace, triton_pod(name, labels=labels, gated=gated))

    def all_serving() -> dict[str, str] | None:
        ips: dict[str, str] = {}
        for name in names:
            status = kube.core.read_namespaced_pod(name, namespace).status
            ip = status.pod_ip if status else None
            if not status or not ip or status.phase != "Running" or not triton_ready(ip):
                return None
            ips[name] = ip
        return ips

    return waiting.wait_for(f"{count} Triton pods serving", all_serving, timeout=90)


def served_config(ip: str, model: str = MODEL) -> dict[str, Any] | None:
    config = http_json(f"{triton_url(ip)}/v2/models/{model}/config")
    return config if isinstance(config, dict) else None


def served_profile(ip: str, model: str = MODEL) -> str | None:
    return modelconfigs.applied_profile(served_config(ip, model) or {})


def queue_delay(ip: str, model: str = MODEL) -> int | None:
    config = served_config(ip, model) or {}
    delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
    return int(delay) if delay is not None else None


def everyone_serves(ips: dict[str, str], profile: str) -> Callable[[], bool]:
    """A check that every Pod's Triton serves `profile` (one of PROFILES): named, and with its
    queue delay."""

    def check() -> bool:
        return all(
            served_profile(ip) == profile and queue_delay(ip) == QUEUE_DELAY[profile]
            for ip in ips.values()
        )

    return check


def pod_condition(kube: Kube, namespace: str, pod: str, kind: str) -> str | None:
    status = kube.core.read_namespaced_pod(pod, namespace).status
    for condition in (status.conditions if status else None) or []:
        if condition.type == kind:
            return str(condition.status)
    return None


def gate_open(kube: Kube, namespace: str, pod: str) -> bool:
    """Whether batchpilot holds the Pod's readiness gate True."""
    return pod_condition(kube, namespace, pod, pods.GATE) == "True"
