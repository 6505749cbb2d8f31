"""Real Triton servers behind real Pods, for e2e tests and the cluster benchmarks: run by a real
kubelet and containerd from the images built from this checkout, on the local cluster's real node
(`batchpilot_cluster.realnodes`), or on kind from the images that `python -m
batchpilot_testbed.kind up` built."""

import contextlib
import copy
import dataclasses
import datetime
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client

from batchpilot.api import names
from batchpilot.kube import pods
from batchpilot_cluster import building, controlplane, images, podsandboxes, realnodes
from batchpilot_harness import local_triton, procfs
from batchpilot_testbed import waiting, watches
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import endpoints, modelconfigs

PROCESS_TIMEOUT_SECONDS = 30.0
"""How long `process_in_pod` waits for a container the kubelet is restarting."""

MODEL = "gpu_sim"
GOVERNED_LABELS = {names.GOVERNED_LABEL: names.GOVERNED_VALUE}
"""The opt-in label: the operator watches only the Pods that carry it."""
PROFILES: dict[str, dict[str, Any]] = {
    "interactive": {"maxQueueDelayMicroseconds": 2000, "preferredBatchSizes": [4, 8]},
    "bulk": {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]},
}
"""The two profiles that the e2e policies and the benchmarks switch between."""
QUEUE_DELAY = {name: profile["maxQueueDelayMicroseconds"] for name, profile in PROFILES.items()}
BASE_SPEC: dict[str, Any] = {
    "target": {
        "selector": {"matchLabels": {"app": "triton"}},
        "port": "http",
        "models": [MODEL],
    },
    "profiles": PROFILES,
    "defaultProfile": "bulk",
    "minDwellSeconds": 0,
    "rollout": {"maxUnavailable": 2},
}
"""The spec of the e2e tests' policies over the Pods `start_tritons` starts, bulk by default."""


def interactive_window(
    profile: str = "interactive", *, at_least_seconds: float = 50
) -> tuple[datetime.datetime, dict[str, str]]:
    """A schedule window of `profile` opening at a minute boundary at least `at_least_seconds`
    away (by default, time for a fleet to settle on bulk and for a lead to start its rollout
    first), and when it opens."""
    now = datetime.datetime.now(datetime.UTC)
    opens = now + datetime.timedelta(seconds=at_least_seconds)
    opens = opens.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    window = {
        "profile": profile,
        "start": opens.strftime("%H:%M"),
        "end": (opens + datetime.timedelta(minutes=10)).strftime("%H:%M"),
    }
    return opens, window


def policy(name: str = "fleet", **spec: Any) -> dict[str, Any]:
    """A BatchPolicy document: BASE_SPEC with `spec`'s top-level fields replacing its own."""
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "metadata": {"name": name},
        "spec": {**copy.deepcopy(BASE_SPEC), **spec},
    }


REPOSITORY_HEADER = "batchpilot-repository-token"
"""The header a locked Triton's model-repository API expects (the API's default)."""
REPOSITORY_TOKEN_VARIABLE = "TRITON_REPOSITORY_TOKEN"
"""The triton container's variable for the header's value, from a Secret, as in the manifest."""

# Set by `python -m batchpilot_testbed.kind test`: the images of real Triton Pods on kind.
TRITON_IMAGE_ENV = "BATCHPILOT_E2E_TRITON_IMAGE"
SIDECAR_IMAGE_ENV = "BATCHPILOT_E2E_SIDECAR_IMAGE"
TRITON_IMAGE = "batchpilot-triton"
SIDECAR_IMAGE = "batchpilot-sidecar"
MODEL_REPOSITORY_IMAGE = images.MODEL_REPOSITORY_IMAGE.name
MODEL_REPOSITORY_IMAGE_ENV = "BATCHPILOT_E2E_MODEL_REPOSITORY_IMAGE"


class PlacementError(Exception):
    """Triton Pods cannot run on this cluster; says what is missing."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where Triton Pods run, and from which images."""

    triton_image: str
    sidecar_image: str
    model_repository_image: str | None = None
    """The demo models as an image of files (manifests/model-repository.Dockerfile), for an
    image volume; None where the run named none."""
    node_selector: dict[str, str] | None = None
    """The local cluster's real node (tainted for GPU Pods, which these tolerate); kind: any."""
    spread_over: tuple[str, ...] = ()
    """Real nodes' label values (``realnodes.NODE_LABEL``): Pods go to these nodes, the same
    number on each as far as they divide (``spread_placement``)."""


def placement(kube: Kube) -> Placement:
    """The local cluster: its real node, with this checkout's images imported into its
    containerd if it lacks them. Elsewhere: the images `python -m batchpilot_testbed.kind test`
    named."""
    if kube.local is not None:
        return _real_node_placement(kube.local)
    triton, sidecar = os.environ.get(TRITON_IMAGE_ENV), os.environ.get(SIDECAR_IMAGE_ENV)
    if not triton or not sidecar:
        raise PlacementError(
            f"no Triton images for this cluster: set ${TRITON_IMAGE_ENV} and "
            f"${SIDECAR_IMAGE_ENV} (python -m batchpilot_testbed.kind test)"
        )
    return Placement(
        triton_image=triton,
        sidecar_image=sidecar,
        model_repository_image=os.environ.get(MODEL_REPOSITORY_IMAGE_ENV) or None,
    )


def spread_placement(kube: Kube) -> Placement:
    """Triton Pods over every real node of the local cluster, one node's share each: replicas
    as a Deployment with a topology spread runs them on a cluster's GPU nodes."""
    if kube.local is None or len(kube.local.real_nodes) < 2:
        raise PlacementError(
            "Pods spread over real nodes need the local cluster with two or more "
            "(`python -m batchpilot_cluster up --real-nodes 2`, as `make test` starts it)"
        )
    return dataclasses.replace(
        _real_node_placement(kube.local),
        node_selector=None,
        spread_over=tuple(node.label_value for node in kube.local.real_nodes),
    )


def on_real_node(kube: Kube, index: int) -> Placement:
    """Triton Pods on real node `index` of the local cluster alone (0: as `placement`)."""
    if kube.local is None or len(kube.local.real_nodes) <= index:
        raise PlacementError(
            f"Pods on real node {index} need the local cluster with {index + 1} or more "
            "(`python -m batchpilot_cluster up --real-nodes 2`, as `make test` starts it)"
        )
    key = realnodes.NODE_LABEL[0]
    return dataclasses.replace(
        _real_node_placement(kube.local),
        node_selector={key: kube.local.real_nodes[index].label_value},
    )


def _real_node_placement(cluster: controlplane.Cluster) -> Placement:
    ctr = building.require_binaries() / "ctr"
    references = {}
    for name in (TRITON_IMAGE, SIDECAR_IMAGE, MODEL_REPOSITORY_IMAGE):
        try:
            built = images.archive(name)
            # Imported once per node: a node cleaned and started again has none.
            for node in cluster.real_nodes:
                if not realnodes.has_image(node, ctr=ctr, reference=built.reference):
                    started = time.monotonic()
                    realnodes.import_image(node, ctr=ctr, archive=built.archive)
                    took = time.monotonic() - started
                    into = f"into {node.name} in {took:.1f} s"
                    print(f"\nimported {built.reference} {into}", flush=True)
        except (images.ImageError, realnodes.NodeError) as error:
            raise PlacementError(f"{error} (`make images` builds them)") from None
        references[name] = built.reference
    key, value = realnodes.NODE_LABEL
    return Placement(
        triton_image=references[TRITON_IMAGE],
        sidecar_image=references[SIDECAR_IMAGE],
        model_repository_image=references[MODEL_REPOSITORY_IMAGE],
        node_selector={key: value},
    )


def pods_run_here(local: bool) -> bool:
    """Whether Triton Pods really run on this cluster: the local one, or kind with images."""
    return local or bool(os.environ.get(TRITON_IMAGE_ENV))


def triton_url(ip: str) -> str:
    """Where the Triton of the Pod at `ip` serves HTTP."""
    return f"http://{ip}:{endpoints.TRITON_HTTP_PORT}"


def sidecar_url(ip: str) -> str:
    return f"http://{ip}:{endpoints.SIDECAR_PORT}"


def tritonserver_arguments(
    *, models: Sequence[str], grpc_max_connection_age_ms: int | None, locked: bool
) -> list[str]:
    """The triton container's arguments, as manifests/triton-deployment.yaml gives them
    (Kubernetes expands the token variable from the container's environment)."""
    token = f"$({REPOSITORY_TOKEN_VARIABLE})"
    credential = (REPOSITORY_HEADER, token) if locked else None
    return [
        "--model-repository=/models",
        "--model-control-mode=explicit",
        *(f"--load-model={model}" for model in models),
        f"--http-port={endpoints.TRITON_HTTP_PORT}",
        f"--grpc-port={endpoints.TRITON_GRPC_PORT}",
        f"--metrics-port={endpoints.TRITON_METRICS_PORT}",
        "--metrics-config=summary_latencies=true",
        *local_triton.restricted_repository_arguments(credential),
        *local_triton.grpc_age_arguments(grpc_max_connection_age_ms),
    ]


def triton_pod(
    name: str,
    *,
    placement: Placement,
    labels: dict[str, str],
    gated: bool,
    models: Sequence[str] = (MODEL,),
    grpc_max_connection_age_ms: int | None = None,
    repository_secret: str | None = None,
    governed: bool = True,
    image_volume: bool = False,
) -> client.V1Pod:
    """A Triton Pod: the triton container runs manifests/triton-deployment.yaml's command,
    flags and readiness probe in the CPU Triton image (tools/batchpilot_cluster/triton.Dockerfile,
    whose /models
    holds the demo models), beside the sidecar. `grpc_max_connection_age_ms` runs Triton with
    `--grpc-max-connection-age`; `repository_secret` locks its model-repository API to
    REPOSITORY_HEADER, the value from that Secret's key `token`, as the manifest does. It carries
    the opt-in label the operator's watch selects (`governed`), as the manifest's Pods do.
    `image_volume` mounts the model-repository image over /models, read-only, as the manifest's
    image-volume variant does (the image's own demo models hidden under it)."""
    if image_volume and not placement.model_repository_image:
        raise PlacementError("no model-repository image for an image volume on this cluster")
    volumes = (
        [
            client.V1Volume(
                name="models",
                image=client.V1ImageVolumeSource(
                    reference=placement.model_repository_image, pull_policy="Never"
                ),
            )
        ]
        if image_volume
        else None
    )
    triton = client.V1Container(
        name="triton",
        image=placement.triton_image,
        image_pull_policy="Never",  # imported into the node's runtime: there is no registry
        command=["tritonserver"],
        args=tritonserver_arguments(
            models=models,
            grpc_max_connection_age_ms=grpc_max_connection_age_ms,
            locked=repository_secret is not None,
        ),
        env=[
            client.V1EnvVar(
                name=REPOSITORY_TOKEN_VARIABLE,
                value_from=client.V1EnvVarSource(
                    secret_key_ref=client.V1SecretKeySelector(name=repository_secret, key="token")
                ),
            )
        ]
        if repository_secret
        else None,
        ports=[
            client.V1ContainerPort(name="http", container_port=endpoints.TRITON_HTTP_PORT),
            client.V1ContainerPort(name="grpc", container_port=endpoints.TRITON_GRPC_PORT),
            client.V1ContainerPort(name="metrics", container_port=endpoints.TRITON_METRICS_PORT),
        ],
        # The manifest's probe, polled each second rather than each five (a test waits less),
        # with as much patience before a serving Triton counts as unready: three failures of
        # five seconds each. A new container is unready until its first success either way.
        readiness_probe=client.V1Probe(
            http_get=client.V1HTTPGetAction(path="/v2/health/ready", port="http"),
            period_seconds=1,
            timeout_seconds=5,
        ),
        volume_mounts=[client.V1VolumeMount(name="models", mount_path="/models", read_only=True)]
        if image_volume
        else None,
    )
    sidecar = client.V1Container(
        name="batchpilot-sidecar",
        image=placement.sidecar_image,
        image_pull_policy="Never",
        args=[
            f"--triton-url={triton_url('127.0.0.1')}",
            f"--listen={endpoints.EVERY_ADDRESS}:{endpoints.SIDECAR_PORT}",
            "--rate-window=5",
        ],
        ports=[client.V1ContainerPort(name="sidecar", container_port=endpoints.SIDECAR_PORT)],
    )
    gates = [client.V1PodReadinessGate(condition_type=pods.GATE)] if gated else None
    spread = bool(placement.spread_over)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name, labels={**labels, **(GOVERNED_LABELS if governed else {})}
        ),
        spec=client.V1PodSpec(
            containers=[triton, sidecar],
            volumes=volumes,
            readiness_gates=gates,
            termination_grace_period_seconds=5,
            node_selector=placement.node_selector,
            affinity=_on_nodes(placement.spread_over) if spread else None,
            topology_spread_constraints=[_spread_by_node(labels)] if spread else None,
            tolerations=[
                client.V1Toleration(key=realnodes.TAINT_KEY, operator="Exists", effect="NoSchedule")
            ],
            enable_service_links=False,
            automount_service_account_token=False,
        ),
    )


def _on_nodes(label_values: Sequence[str]) -> client.V1Affinity:
    """Only the real nodes with these values of ``realnodes.NODE_LABEL``."""
    on = client.V1NodeSelectorRequirement(
        key=realnodes.NODE_LABEL[0], operator="In", values=list(label_values)
    )
    return client.V1Affinity(
        node_affinity=client.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                node_selector_terms=[client.V1NodeSelectorTerm(match_expressions=[on])]
            )
        )
    )


def _spread_by_node(labels: dict[str, str]) -> client.V1TopologySpreadConstraint:
    """As many of the Pods `labels` picks on each node as can be, never one more than another."""
    return client.V1TopologySpreadConstraint(
        max_skew=1,
        topology_key="kubernetes.io/hostname",
        when_unsatisfiable="DoNotSchedule",
        label_selector=client.V1LabelSelector(match_labels=labels),
    )


def create_service(
    kube: Kube, namespace: str, *, selector: dict[str, str], name: str = "triton"
) -> str:
    """A ClusterIP Service for Triton's HTTP and gRPC ports on the Pods `selector` picks; its
    cluster IP. Its endpoints are the Ready Pods (kube-controller-manager), and kube-proxy routes
    new connections to them."""
    service = client.V1Service(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ServiceSpec(
            selector=selector,
            ports=[
                client.V1ServicePort(name=port, port=number, target_port=port, protocol="TCP")
                for port, number in (
                    ("http", endpoints.TRITON_HTTP_PORT),
                    ("grpc", endpoints.TRITON_GRPC_PORT),
                )
            ],
        ),
    )
    created = kube.core.create_namespaced_service(namespace, service)
    assert created.spec is not None
    return str(created.spec.cluster_ip)


def ready_endpoints(kube: Kube, namespace: str, service: str) -> set[str]:
    """The addresses a Service's EndpointSlices list as ready."""
    slices = client.DiscoveryV1Api(kube.api_client).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}"
    )
    return {
        address
        for endpoint_slice in slices.items
        for endpoint in endpoint_slice.endpoints or []
        if endpoint.conditions is not None and endpoint.conditions.ready
        for address in endpoint.addresses
    }


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
    grpc_max_connection_age_ms: int | None = None,
    repository_secret: str | None = None,
    image_volume: bool = False,
    where: Placement | None = None,
) -> dict[str, str]:
    """Create `count` Triton Pods (on the real node, or as `where` places them) and wait until
    each serves; their IPs by name."""
    labels = labels or {"app": "triton"}
    names = [f"{prefix}-{index}" for index in range(count)]
    where = where or placement(kube)
    for name in names:
        pod = triton_pod(
            name,
            placement=where,
            labels=labels,
            gated=gated,
            grpc_max_connection_age_ms=grpc_max_connection_age_ms,
            repository_secret=repository_secret,
            image_volume=image_volume,
        )
        kube.core.create_namespaced_pod(namespace, pod)

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


def all_gates_open(kube: Kube, namespace: str, names: Iterable[str]) -> Callable[[], bool]:
    """A check that batchpilot holds the readiness gate of every Pod named True."""
    wanted = list(names)
    return lambda: all(gate_open(kube, namespace, pod) for pod in wanted)


def process_in_pod(ip: str, program: str, *, timeout: float = PROCESS_TIMEOUT_SECONDS) -> int:
    """The pid of the process of the Pod at `ip` (on the local cluster's real node) that runs
    `program`: an executable's name (tritonserver) or a Python module's (batchpilot_sidecar).
    A container the kubelet is restarting has none for a moment: wait up to `timeout` for it."""

    def runs(pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return program in [Path(arg.decode(errors="replace")).name for arg in argv[:3]]

    def the_one() -> int | None:
        running = {pid for pid in podsandboxes.pids(ip) if runs(pid)}
        # Triton forks before it execs a Python stub: for that instant the child's cmdline is
        # its parent's. The program is the process whose parent is not itself a copy.
        programs = [
            pid for pid in running if (stat := procfs.stat(pid)) and stat.parent not in running
        ]
        return programs[0] if len(programs) == 1 else None

    return waiting.wait_for(f"{program} running in the Pod at {ip}", the_one, timeout=timeout)


def pod_log(kube: Kube, namespace: str, pod: str, container: str) -> str:
    """What the current run of a Pod's container has written so far (the kubelet's log)."""
    try:
        return str(kube.core.read_namespaced_pod_log(pod, namespace, container=container))
    except client.ApiException:
        return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restart:
    """A container the kubelet restarted, and how its last run ended."""

    pod: str
    container: str
    count: int
    exit_code: int | None
    reason: str
    previous_log: str
    """The last lines its previous run wrote: a Triton that crashed in a reload (exit 139)
    says why only there, and the kubelet drops them with the Pod."""

    def describe(self) -> str:
        ended = f"exit {self.exit_code} ({self.reason})" if self.exit_code is not None else "?"
        return f"{self.pod}/{self.container} restarted {self.count}x, last run ended {ended}"


def container_restarts(kube: Kube, namespace: str, *, tail: int) -> list[Restart]:
    """Every container of the namespace's Pods that restarted, with its previous run's last
    `tail` lines."""
    found = []
    for pod in kube.core.list_namespaced_pod(namespace).items:
        pod_name = str(pod.metadata.name if pod.metadata else "")
        for status in (pod.status.container_statuses if pod.status else None) or []:
            if not status.restart_count:
                continue
            ended = status.last_state.terminated if status.last_state else None
            log = kube.kubectl(
                "logs", "-n", namespace, pod_name, "-c", status.name, "--previous",
                f"--tail={tail}",
            )  # fmt: skip
            found.append(
                Restart(
                    pod=pod_name,
                    container=str(status.name),
                    count=int(status.restart_count),
                    exit_code=ended.exit_code if ended else None,
                    reason=str(ended.reason or "") if ended else "",
                    previous_log=log,
                )
            )
    return found


class ReadyAfterRestart:
    """Watches one Pod from a thread while a test breaks it: each time the kubelet calls the Pod
    Ready after its triton container restarted, which profile its Triton serves. A Pod Ready on
    any other than the decided one takes requests on the repository's settings."""

    def __init__(self, kube: Kube, namespace: str, pod: str, ip: str, *, decided: str) -> None:
        self.kube, self.namespace, self.pod, self.ip = kube, namespace, pod, ip
        self.decided = decided
        self.first_run = self._restarts()
        self.restarted = False
        self.ready_samples = 0
        self.wrong: list[str | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _restarts(self) -> int:
        status = self.kube.core.read_namespaced_pod(self.pod, self.namespace).status
        return sum(
            container.restart_count
            for container in (status.container_statuses if status else None) or []
            if container.name == "triton"
        )

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(client.ApiException, OSError):
                if self._restarts() == self.first_run:
                    continue
                self.restarted = True
                if pod_condition(self.kube, self.namespace, self.pod, "Ready") != "True":
                    continue
                self.ready_samples += 1
                served = served_profile(self.ip)
                if served != self.decided:
                    self.wrong.append(served)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def users_deployment(
    name: str,
    *,
    placement: Placement,
    replicas: int,
    labels: dict[str, str],
    template_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Triton Deployment as a user has it before batchpilot: one container running
    tritonserver with manifests/triton-deployment.yaml's flags for the model, without what
    batchpilot adds (the restricted-API flags and their credential, port names, the sidecar, the
    readiness gate, the governed label). `template_labels` and `annotations` go on its Pod
    template beside `labels` (the opt-in)."""
    triton = {
        "name": "triton",
        "image": placement.triton_image,
        "imagePullPolicy": "Never",  # imported into the node's runtime: there is no registry
        "command": ["tritonserver"],
        "args": tritonserver_arguments(
            models=(MODEL,), grpc_max_connection_age_ms=None, locked=False
        ),
        "ports": [
            {"containerPort": port}
            for port in (
                endpoints.TRITON_HTTP_PORT,
                endpoints.TRITON_GRPC_PORT,
                endpoints.TRITON_METRICS_PORT,
            )
        ],
        # As triton_pod's: polled each second, so a test waits less.
        "readinessProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": endpoints.TRITON_HTTP_PORT},
            "periodSeconds": 1,
            "timeoutSeconds": 5,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": {**labels, **(template_labels or {})},
                    **({"annotations": annotations} if annotations else {}),
                },
                "spec": {
                    "containers": [triton],
                    "terminationGracePeriodSeconds": 5,
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    **(
                        {"nodeSelector": placement.node_selector} if placement.node_selector else {}
                    ),
                    "tolerations": [
                        {"key": realnodes.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
                    ],
                },
            },
        },
    }


@dataclasses.dataclass(frozen=True)
class PodState:
    ready: bool
    """The kubelet's Ready condition: what the endpoint controller reads."""
    leaving: bool
    """batchpilot's readiness gate is False: the kubelet is about to make it not Ready."""


@dataclasses.dataclass
class Readiness:
    """Each Pod's Ready condition and readiness gate as a watch saw them, after each change, in
    the API server's order: the operator's gate writes and the kubelet's Ready writes as the
    endpoint controller reads them."""

    snapshots: list[dict[str, PodState]] = dataclasses.field(default_factory=list)

    def left(self) -> set[str]:
        """The Pods whose gate the watch saw False: those batchpilot took out of their Services."""
        return {
            pod for snapshot in self.snapshots for pod, state in snapshot.items() if state.leaving
        }

    def fewest_serving(self) -> int:
        """The fewest Pods at once that were Ready and not leaving (their gate not False).
        0 means a Pod was taken out while none other was Ready to stay: a moment, short or
        not, when the Service could be left with no endpoint."""
        return min(
            (
                sum(state.ready and not state.leaving for state in snapshot.values())
                for snapshot in self.snapshots
            ),
            default=0,
        )


@contextlib.contextmanager
def readiness_watched(kube: Kube, namespace: str, selector: str) -> Iterator[Readiness]:
    """The Ready condition and readiness gate of the Pods `selector` picks while the block runs,
    from a watch started before it (its first snapshots are the Pods as they were): a moment
    too short for polling to catch too."""
    readiness = Readiness()
    states: dict[str, PodState] = {}

    def on_event(event: dict[str, Any]) -> None:
        pod = event["object"]
        name = str(pod.metadata.name)
        if event["type"] == "DELETED":
            states.pop(name, None)
        else:
            conditions = {
                c.type: c.status for c in (pod.status.conditions if pod.status else None) or []
            }
            states[name] = PodState(
                ready=conditions.get("Ready") == "True",
                leaving=conditions.get(pods.GATE) == "False",
            )
        if not readiness.snapshots or readiness.snapshots[-1] != states:
            readiness.snapshots.append(dict(states))

    with watches.followed(
        kube.core.list_namespaced_pod,
        namespace,
        label_selector=selector,
        on_event=on_event,
        what=f"Pods {selector} in {namespace}",
    ):
        yield readiness
