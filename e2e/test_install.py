"""The path a user walks, on the cluster's real node: images, `helm install` of the previous
chart, the example Triton Deployment, a policy, a hitless switch under load, the CRDs and `helm
upgrade` to this chart, `helm uninstall`.

Everything a user would run is run as they would run it: helm and kubectl with files, the
Deployment from manifests/triton-deployment.yaml with only its replicas and images changed, the
Secret and the claim it asks for created first. The one thing a cluster's device plugin would do
is done by hand: the real node advertises `nvidia.com/gpu` through its status capacity, as
Kubernetes' "Advertise Extended Resources for a Node" task does, and the node's GPU taint lets the
Deployment's Pods on by the API server's ExtendedResourceToleration plugin alone.

What the containers are is checked inside them, from the host: each container's processes (its
cgroup's `cgroup.procs` under the node's cgroup root) run as the image's non-root user with no
capabilities, no new privileges and a seccomp filter, on a read-only root (mountinfo), and a write
there through the runtime (`crictl exec`) is refused.
"""

import contextlib
import copy
import dataclasses
import json
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Self

import pytest
import yaml

from batchpilot.admission import injections
from batchpilot.api import names
from batchpilot.kube import pods
from batchpilot_cluster import building, images, podnetwork, realnodes
from batchpilot_testbed import charts, clients, fleet, namespaces, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import endpoints

# The chart's operator serves every namespace: beside another test it would switch that test's
# Pods too.
pytestmark = [pytest.mark.e2e, pytest.mark.cluster_wide]

REPO = charts.REPO
DEPLOYMENT = REPO / "manifests" / "triton-deployment.yaml"
MODEL_REPOSITORY = REPO / "manifests" / "model-repository"
OPERATOR_IMAGE, SIDECAR_IMAGE, TRITON_IMAGE = (
    "batchpilot-operator",
    "batchpilot-sidecar",
    "batchpilot-triton",
)
GPU = "nvidia.com/gpu"
GPU_CAPACITY = "/status/capacity/nvidia.com~1gpu"
"""The JSON pointer to it in a Node (`/` escaped as `~1`)."""
GPUS = 4
"""What the node advertises: the 3 replicas, and a surge Pod."""
REPLICAS = 3
TRITON_LABELS = "app.kubernetes.io/name=triton"
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"
CREDENTIAL = "triton-repository-credential"
CLAIM = "triton-model-repository"
UPGRADED_INTERVAL = 7
PREVIOUS_CHART = "bf5c4c3"
"""The commit that last changed the chart before the CRDs carried a revision (no release is
tagged yet): the test installs its chart, then upgrades to this checkout's. Both run this
checkout's images."""
CRD = "customresourcedefinition/batchpolicies.batchpilot.dev"
REVISION = "batchpilot.dev/crd-revision"
RATE = 50.0
"""Requests per second through the Service while the fleet flips and back."""
POLICY = """\
apiVersion: batchpilot.dev/v1alpha1
kind: BatchPolicy
metadata:
  name: triton
spec:
  target:
    selector:
      matchLabels: {app.kubernetes.io/name: triton}
    repositoryCredential: {secretName: triton-repository-credential}
    port: http
    models: [gpu_sim]
  profiles:
    interactive: {maxQueueDelayMicroseconds: 2000, preferredBatchSizes: [4, 8]}
    bulk: {maxQueueDelayMicroseconds: 20000, preferredBatchSizes: [32, 64]}
  defaultProfile: bulk
  minDwellSeconds: 0
  rollout: {maxUnavailable: 1}
"""
"""What a user writes: gpu_sim, two profiles, the credential the Deployment's Secret holds."""


# -- what the user runs


def node_images(kube: Kube) -> dict[str, str]:
    """The three images built from this checkout (`make images`), imported into the real node's
    containerd; their references by name."""
    assert kube.local is not None
    ctr = building.require_binaries() / "ctr"
    references = {}
    for name in (OPERATOR_IMAGE, SIDECAR_IMAGE, TRITON_IMAGE):
        try:
            built = images.archive(name)
        except images.ImageError as error:
            pytest.fail(f"{error} (`make images` builds them)")
        started = time.monotonic()
        realnodes.import_image(kube.local.node, ctr=ctr, archive=built.archive)
        print(f"imported {built.reference} in {time.monotonic() - started:.1f} s")
        references[name] = built.reference
    return references


def kubectl(kube: Kube, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
    done = kube.kubectl_run(*args, stdin=stdin, timeout=timeout)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def as_the_user_wrote_it(pod: dict[str, Any]) -> dict[str, Any]:
    """A running Triton Pod as its user would write it to opt in: without the sidecar, the
    readiness gate and the governed label batchpilot's manifest adds by hand, with the opt-in
    label."""
    spec = copy.deepcopy(pod["spec"])
    spec["containers"] = [
        container
        for container in spec["containers"]
        if container["name"] != injections.SIDECAR_CONTAINER
    ]
    for injected in ("readinessGates", "nodeName"):
        spec.pop(injected, None)
    labels = {
        key: value
        for key, value in pod["metadata"]["labels"].items()
        if key not in (names.GOVERNED_LABEL, "pod-template-hash")
    }
    metadata = {"generateName": "opted-in-", "labels": {**labels, names.INJECT_LABEL: "true"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def previous_chart(into: Path) -> Path:
    """The chart as PREVIOUS_CHART had it, from git (`git archive`), as a user has it from the
    release before."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_CHART, "charts/batchpilot"],
        check=True, capture_output=True, timeout=60,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=60)
    return into / "charts" / "batchpilot"


def helm(kube: Kube, *args: str, timeout: float = 300) -> str:
    done = charts.helm(
        *args, "--kubeconfig", str(kube.kubeconfig), "--kube-context", kube.context,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"helm {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def chart_values(operator_image: str) -> dict[str, Any]:
    """What the install sets: the image, imported rather than pulled, and the scheduling the
    e2e cluster needs (its one node that runs containers is a tainted GPU node)."""
    repository, tag = operator_image.rsplit(":", 1)
    key, value = realnodes.NODE_LABEL
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "nodeSelector": {key: value},
        "tolerations": [{"key": realnodes.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }


def users_deployment(triton_image: str, sidecar_image: str) -> list[dict[str, Any]]:
    """manifests/triton-deployment.yaml with 3 replicas and the two images swapped for the
    ones built here; nothing else changed (checked)."""
    original = [document for document in yaml.safe_load_all(DEPLOYMENT.read_text()) if document]
    changed = copy.deepcopy(original)
    (deployment,) = [document for document in changed if document["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = REPLICAS
    images_by_container = {"triton": triton_image, "batchpilot-sidecar": sidecar_image}
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        container["image"] = images_by_container[container["name"]]
    # The same documents once those three fields are put back.
    restored = copy.deepcopy(changed)
    (back,) = [document for document in restored if document["kind"] == "Deployment"]
    (before,) = [document for document in original if document["kind"] == "Deployment"]
    back["spec"]["replicas"] = before["spec"]["replicas"]
    for container, was in zip(
        back["spec"]["template"]["spec"]["containers"],
        before["spec"]["template"]["spec"]["containers"],
        strict=True,
    ):
        container["image"] = was["image"]
    assert restored == original
    return changed


def model_volume(namespace: str, name: str) -> str:
    """A PersistentVolume over this checkout's model repository, bound to the Deployment's claim,
    and the claim (read-only, as the Deployment mounts it)."""
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(MODEL_REPOSITORY), "type": "Directory"},
            "claimRef": {"namespace": namespace, "name": CLAIM},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return yaml.safe_dump_all([volume, claim])


# -- what the cluster says


def pod_list(kube: Kube, namespace: str, selector: str) -> list[Any]:
    return [
        pod
        for pod in kube.core.list_namespaced_pod(namespace, label_selector=selector).items
        if pod.metadata and not pod.metadata.deletion_timestamp
    ]


def conditions_of(pod: Any) -> dict[str, str]:
    return {c.type: c.status for c in (pod.status.conditions if pod.status else None) or []}


def restarts(pod: Any) -> int:
    return sum(s.restart_count for s in (pod.status.container_statuses or []))


def containers_ready(kube: Kube, namespace: str, selector: str, count: int) -> list[Any] | None:
    found = pod_list(kube, namespace, selector)
    ok = len(found) == count and all(
        conditions_of(pod).get("ContainersReady") == "True" for pod in found
    )
    return found if ok else None


def gates(kube: Kube, namespace: str) -> dict[str, str]:
    return {
        pod.metadata.name: conditions_of(pod).get(pods.GATE, "unset")
        for pod in pod_list(kube, namespace, TRITON_LABELS)
    }


def bp_columns(kube: Kube, namespace: str) -> dict[str, str]:
    """`kubectl get bp` as a user reads it: its header's columns and the policy's row."""
    header, row = kubectl(kube, "get", "bp", "-n", namespace).splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=False))


def gpu_resources(kube: Kube) -> tuple[str | None, str | None]:
    status = kube.core.read_node(realnodes.NAME).status
    assert status is not None
    return (status.capacity or {}).get(GPU), (status.allocatable or {}).get(GPU)


def peers(kube: Kube, release: str) -> dict[str, Any]:
    """The operator replicas in the release's ClusterKopfPeering (kopf writes one key each)."""
    got = json.loads(kubectl(kube, "get", "clusterkopfpeering", release, "-o", "json"))
    status: dict[str, Any] = got.get("status") or {}
    return status


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def timestamps(pod: Any) -> dict[str, float]:
    """Seconds from the Pod's creation to each condition's last transition (the kubelet's and
    the operator's clocks, 1 s resolution)."""
    created = pod.metadata.creation_timestamp
    return {
        c.type: (c.last_transition_time - created).total_seconds()
        for c in pod.status.conditions or []
        if c.last_transition_time is not None
    }


class Readiness:
    """Polls the Triton Pods a few times a second; each Pod's (gate, Ready) states in order."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self.history: dict[str, list[tuple[str, str]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # an API hiccup keeps the last view
                for pod in pod_list(self.kube, self.namespace, TRITON_LABELS):
                    listed = conditions_of(pod)
                    state = (listed.get(pods.GATE, "unset"), listed.get("Ready", "unset"))
                    history = self.history.setdefault(pod.metadata.name, [])
                    if not history or history[-1] != state:
                        history.append(state)
            self._stop.wait(0.1)

    def gate_went_false(self) -> set[str]:
        return {pod for pod, states in self.history.items() if any(g == "False" for g, _ in states)}


# -- inside the containers


@dataclasses.dataclass(frozen=True)
class Process:
    pid: int
    command: str
    uids: tuple[int, ...]
    effective_capabilities: int
    no_new_privileges: bool
    seccomp_filtered: bool
    mounts: dict[str, set[str]]
    """Mount point (as the process sees it) to its options."""


def read_process(pid: int) -> Process:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    mounts = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        mounts[fields[4]] = set(fields[5].split(","))
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Process(
        pid=pid,
        command=" ".join(arg.decode(errors="replace") for arg in argv if arg),
        uids=tuple(int(uid) for uid in status["Uid"].split()),
        effective_capabilities=int(status["CapEff"].strip(), 16),
        no_new_privileges=status["NoNewPrivs"].strip() == "1",
        seccomp_filtered=status["Seccomp"].strip() == "2",
        mounts=mounts,
    )


def container_id(pod: Any, container: str) -> str:
    (found,) = [s for s in pod.status.container_statuses or [] if s.name == container]
    runtime, _, identifier = str(found.container_id).partition("://")
    assert runtime == "containerd", found.container_id
    return identifier


def container_processes(identifier: str) -> list[Process]:
    """Every process of the container: its cgroup's, under the node's cgroup root."""
    root = realnodes.CGROUP_MOUNTS / "pids" / realnodes.CGROUP_ROOT
    (cgroup,) = [path for path in root.rglob(identifier) if (path / "cgroup.procs").is_file()]
    pids = [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    assert pids, f"no process in {cgroup}"
    return [read_process(pid) for pid in pids]


def crictl(kube: Kube, *args: str) -> tuple[int, str]:
    assert kube.local is not None
    endpoint = f"unix://{kube.local.node.containerd_socket}"
    argv = [str(building.require_binaries() / "crictl"), "--runtime-endpoint", endpoint,
            "--image-endpoint", endpoint, "--timeout", "20s", *args]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, done.stdout + done.stderr


def check_container(
    kube: Kube, pod: Any, container: str, *, uid: int, read_only: tuple[str, ...] = ()
) -> list[Process]:
    """Its processes run as `uid`, unprivileged, on a read-only root; the mounts `read_only`
    are read-only too; a write to its root through the runtime is refused."""
    identifier = container_id(pod, container)
    processes = container_processes(identifier)
    where = f"{pod.metadata.name}/{container}"
    for process in processes:
        assert process.uids == (uid,) * 4, (where, process)
        assert process.effective_capabilities == 0, (where, process)
        assert process.no_new_privileges, (where, process)
        assert process.seccomp_filtered, (where, process)
        for mount in ("/", *read_only):
            assert "ro" in process.mounts[mount], (where, mount, process.mounts.get(mount))
    # Python, not `touch`: the operator's and sidecar's images have no shell or coreutils.
    probe = "open('/batchpilot-write-probe', 'w')"
    status, output = crictl(kube, "exec", identifier, "python", "-c", probe)
    assert status != 0, (where, output)
    assert "Read-only file system" in output, (where, output)
    return processes


# -- what helm leaves


def release_objects(manifest: str) -> list[tuple[str, str, str]]:
    """(kind, namespace or "", name) of every object in a release's manifest."""
    return [
        (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
        for d in yaml.safe_load_all(manifest)
        if d
    ]


def labelled_leftovers(kube: Kube, release: str) -> list[str]:
    """Every object of any listable kind, in any namespace, labelled as the release's."""
    kinds = kubectl(kube, "api-resources", "--verbs=list", "-o", "name").split()
    kinds = [kind for kind in kinds if kind not in ("events", "events.events.k8s.io")]
    listed = kubectl(
        kube, "get", ",".join(kinds), "-A", "-o", "name",
        "-l", f"app.kubernetes.io/instance={release}",
    )  # fmt: skip
    return listed.split()


def still_there(kube: Kube, objects: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    left = []
    for kind, namespace, name in objects:
        got = kube.kubectl_run(
            "get", kind, name, *(["-n", namespace] if namespace else []), "-o", "name"
        )
        if got.returncode == 0 or "NotFound" not in got.stderr:
            left.append((kind, namespace, name))
    return left


@pytest.fixture
def real_node(kube: Kube) -> Kube:
    if kube.local is None:
        pytest.skip("needs the local cluster's real node")
    return kube


@pytest.mark.timeout(900)
def test_a_user_installs_switches_hitlessly_upgrades_and_uninstalls_on_a_real_node(
    real_node: Kube, client_host: podnetwork.Host, tmp_path: Path
) -> None:
    kube = real_node
    began = time.monotonic()
    suffix = uuid.uuid4().hex[:6]
    release, system, volume = f"batchpilot-{suffix}", f"bp-system-{suffix}", f"models-{suffix}"
    with contextlib.ExitStack() as cleanup:
        # 1. The images on the node; the node advertises GPUs, and the kubelet keeps them.
        references = node_images(kube)
        patch_node = ("patch", "node", realnodes.NAME, "--subresource=status", "--type=json")
        removal = [{"op": "remove", "path": GPU_CAPACITY}]
        cleanup.callback(kube.kubectl_run, *patch_node, "-p", json.dumps(removal))
        advertised = [{"op": "add", "path": GPU_CAPACITY, "value": str(GPUS)}]
        kubectl(kube, *patch_node, "-p", json.dumps(advertised))
        waiting.wait_for(
            "the kubelet to make the GPUs allocatable",
            lambda: gpu_resources(kube) == (str(GPUS), str(GPUS)),
            timeout=30,
        )

        # 2. helm install into a namespace that enforces the restricted standard.
        triton = cleanup.enter_context(
            namespaces.created(kube, f"triton-{suffix}", label="batchpilot.dev/e2e")
        )
        cleanup.enter_context(namespaces.created(kube, system, label="batchpilot.dev/e2e"))
        for namespace in (system, triton):
            kubectl(kube, "label", "namespace", namespace, RESTRICTED)
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(chart_values(references[OPERATOR_IMAGE])))
        installing = time.monotonic()
        cleanup.callback(
            charts.helm, "uninstall", release, "-n", system, "--kubeconfig", str(kube.kubeconfig),
            "--kube-context", kube.context, "--wait", "--timeout", "60s", timeout=90,
        )  # fmt: skip
        helm(kube, "install", release, str(previous_chart(tmp_path)), "-n", system, "-f",
             str(values), "--wait", "--timeout", "240s")  # fmt: skip
        print(f"helm install --wait: {time.monotonic() - installing:.1f} s")
        operator_selector = f"app.kubernetes.io/instance={release}"
        operators = pod_list(kube, system, operator_selector)
        assert len(operators) == 2
        for pod in operators:
            assert pod.spec.node_name == realnodes.NAME
            assert conditions_of(pod).get("Ready") == "True"
            assert restarts(pod) == 0
        waiting.wait_for("both replicas in the peering", lambda: len(peers(kube, release)) == 2)

        # 3. What the Deployment's comments say to create first, then the Deployment.
        token = secrets.token_hex(32)
        kubectl(kube, "create", "secret", "generic", CREDENTIAL, "-n", triton,
                f"--from-literal=token={token}")  # fmt: skip
        cleanup.callback(kube.kubectl_run, "delete", "persistentvolume", volume, "--wait=false")
        kubectl(kube, "apply", "-f", "-", stdin=model_volume(triton, volume))
        deployment = tmp_path / "triton-deployment.yaml"
        deployment.write_text(
            yaml.safe_dump_all(
                users_deployment(references[TRITON_IMAGE], references[SIDECAR_IMAGE])
            )
        )
        applied = time.monotonic()
        kubectl(kube, "apply", "-n", triton, "-f", str(deployment))
        tritons = waiting.wait_for(
            f"{REPLICAS} Triton Pods with their containers Ready",
            lambda: containers_ready(kube, triton, TRITON_LABELS, REPLICAS),
            timeout=300,
            interval=0.5,
        )
        print(f"apply to {REPLICAS} Pods' containers Ready: {time.monotonic() - applied:.1f} s")
        ips = {pod.metadata.name: pod.status.pod_ip for pod in tritons}
        for pod in tritons:
            assert pod.spec.node_name == realnodes.NAME
            # The API server's plugin, not the user, gave the Pod its toleration.
            assert any(t.key == GPU for t in pod.spec.tolerations or []), pod.spec.tolerations
            # The gate holds Ready back until a policy governs the Pod.
            assert conditions_of(pod).get("Ready") == "False"
        assert kubectl(kube, "get", "pvc", CLAIM, "-n", triton, "-o",
                       "jsonpath={.status.phase}") == "Bound"  # fmt: skip

        # 4. The policy; clients through the Service from a client network namespace.
        policy = tmp_path / "policy.yaml"
        policy.write_text(POLICY)
        governed = time.monotonic()
        kubectl(kube, "apply", "-n", triton, "-f", str(policy))
        waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=120)
        waiting.wait_for(
            "every Pod Ready through its gate",
            lambda: all(
                conditions_of(pod).get("Ready") == "True"
                for pod in pod_list(kube, triton, TRITON_LABELS)
            ),
            timeout=60,
        )
        print(f"policy applied to every Pod Ready: {time.monotonic() - governed:.1f} s")
        for pod in pod_list(kube, triton, TRITON_LABELS):
            since = timestamps(pod)
            print(
                f"{pod.metadata.name}: created to ContainersReady {since['ContainersReady']:.0f} s,"
                f" to Ready (gate opened) {since['Ready']:.0f} s"
            )
        service = kube.core.read_namespaced_service("triton", triton).spec
        assert service is not None
        service_ip = str(service.cluster_ip)
        waiting.wait_for(
            "every Pod behind the Service",
            lambda: fleet.ready_endpoints(kube, triton, "triton") == set(ips.values()),
            timeout=30,
        )
        assert bp_columns(kube, triton)["PROFILE"] == "bulk"

        load = clients.ClientProcess(
            client_host,
            style="new-connection",
            address=f"{service_ip}:{endpoints.TRITON_HTTP_PORT}",
            rate=RATE,
            seed=25,
        )
        with load, Readiness(kube, triton) as readiness:
            load.start()
            time.sleep(3)
            overridden = POLICY + "  override: {profile: interactive, reason: e2e}\n"
            policy.write_text(overridden)
            kubectl(kube, "apply", "-n", triton, "-f", str(policy))
            flipping = time.monotonic()
            waiting.wait_for(
                "interactive everywhere", fleet.everyone_serves(ips, "interactive"), timeout=120
            )
            waiting.wait_for(
                "every gate back", lambda: set(gates(kube, triton).values()) == {"True"}
            )
            waiting.wait_for(
                "`kubectl get bp` to show interactive",
                lambda: bp_columns(kube, triton)["PROFILE"] == "interactive",
            )
            flipped = time.monotonic() - flipping
            policy.write_text(POLICY)
            kubectl(kube, "apply", "-n", triton, "-f", str(policy))
            flipping = time.monotonic()
            waiting.wait_for("bulk everywhere", fleet.everyone_serves(ips, "bulk"), timeout=120)
            waiting.wait_for(
                "every gate back", lambda: set(gates(kube, triton).values()) == {"True"}
            )
            flopped = time.monotonic() - flipping
            time.sleep(2)
            records = load.stop()
        failures = [record for record in records if not record.succeeded]
        slowest = max(record.latency or 0.0 for record in records)
        print(
            f"{len(records)} requests through the Service, {len(failures)} failed, slowest "
            f"{slowest * 1000:.0f} ms; flip {flipped:.1f} s, back {flopped:.1f} s; "
            f"(gate, Ready) per Pod: {readiness.history}"
        )
        assert len(records) > RATE * 10
        assert not failures, [record.error for record in failures[:5]]
        assert readiness.gate_went_false() == set(ips)
        for pod, states in readiness.history.items():
            # The kubelet's Ready follows the gate: False while switching, True after.
            assert ("False", "False") in states, (pod, states)
            assert states[-1] == ("True", "True"), (pod, states)
        assert bp_columns(kube, triton)["PROFILE"] == "bulk"

        # Inside the containers: non-root, unprivileged, read-only roots.
        for pod in pod_list(kube, triton, TRITON_LABELS):
            served = check_container(kube, pod, "triton", uid=1000, read_only=("/models",))
            assert any("tritonserver" in p.command for p in served)
            check_container(kube, pod, "batchpilot-sidecar", uid=65532, read_only=("/models",))
        for pod in pod_list(kube, system, operator_selector):
            check_container(kube, pod, "operator", uid=65532)
            assert conditions_of(pod).get("Ready") == "True"
            assert restarts(pod) == 0
        # The sidecar reads the repository through its mount: it lists gpu_sim's versions.
        ip = next(iter(ips.values()))
        arguments = f"{fleet.sidecar_url(ip)}/v1/models/{{}}/engine-arguments"
        status, body = http_get(arguments.format("gpu_sim"))
        assert status == 404, body
        assert "no model.json in a version directory of /models/gpu_sim" in body
        status, body = http_get(arguments.format("absent"))
        assert status == 404, body
        assert "is not in the model repository" in body

        # 5. The upgrade to this chart, with a new interval: the CRDs first (helm never upgrades
        # crds/), then the chart; new operator Pods run with it, the policy and the fleet stay.
        before = json.loads(kubectl(kube, "get", "bp", "triton", "-n", triton, "-o", "json"))
        with Readiness(kube, triton) as readiness:
            old = {pod.metadata.name for pod in pod_list(kube, system, operator_selector)}
            interval = f"operator.interval={UPGRADED_INTERVAL}"
            # The new chart's defaults (its webhook on) under the values set at install.
            upgrade = ("upgrade", release, str(charts.CHART), "-n", system,
                       "--reset-then-reuse-values",
                       "--set", interval, "--wait", "--timeout", "240s")  # fmt: skip
            # A CRD of another release: the chart refuses, saying what to do.
            kubectl(kube, "annotate", "--overwrite", CRD, f"{REVISION}=another-release")
            refused = charts.helm(*upgrade, "--kubeconfig", str(kube.kubeconfig),
                                  "--kube-context", kube.context, timeout=300)  # fmt: skip
            assert refused.returncode != 0
            assert "apply this release's CRDs first" in refused.stderr, refused.stderr
            kubectl(kube, "apply", "--server-side", "--force-conflicts", "-f",
                    str(REPO / "crds"))  # fmt: skip
            helm(kube, *upgrade)
            upgraded = waiting.wait_for(
                "only the upgraded operator Pods",
                lambda: (
                    found
                    if len(found := pod_list(kube, system, operator_selector)) == 2
                    and not {pod.metadata.name for pod in found} & old
                    and all(conditions_of(pod).get("Ready") == "True" for pod in found)
                    else None
                ),
                timeout=120,
            )
            for pod in upgraded:
                assert restarts(pod) == 0
                running = [p.command for p in container_processes(container_id(pod, "operator"))]
                assert any(f"--interval={UPGRADED_INTERVAL}" in c for c in running), running
            # The API server calls the webhook in the new operator Pods, through its Service
            # with the chart's certificate: a Pod that opts in comes back joined (a dry run).
            pod = json.loads(kubectl(kube, "get", "pod", "-n", triton, "-o", "json",
                                     next(iter(ips))))  # fmt: skip
            opted_in = json.dumps(as_the_user_wrote_it(pod))
            admitted = json.loads(kubectl(kube, "create", "--dry-run=server", "-o", "json",
                                          "-n", triton, "-f", "-", stdin=opted_in))  # fmt: skip
            containers = [container["name"] for container in admitted["spec"]["containers"]]
            assert containers == ["triton", injections.SIDECAR_CONTAINER], containers
            gate = {"conditionType": names.CONFIG_APPLIED_GATE}
            assert admitted["spec"]["readinessGates"] == [gate]
            assert admitted["metadata"]["labels"][names.GOVERNED_LABEL] == names.GOVERNED_VALUE
            time.sleep(3 * UPGRADED_INTERVAL)  # passes of the new operator
            assert bp_columns(kube, triton)["PROFILE"] == "bulk"
            assert fleet.everyone_serves(ips, "bulk")()
        # None lost, none re-applied: the same policy, unchanged, and no gate went False.
        after = json.loads(kubectl(kube, "get", "bp", "triton", "-n", triton, "-o", "json"))
        for key in ("uid", "generation"):
            assert after["metadata"][key] == before["metadata"][key], key
        assert after["spec"] == before["spec"]
        assert not readiness.gate_went_false(), readiness.history
        assert set(gates(kube, triton).values()) == {"True"}

        # 6. The user deletes the policy, then uninstalls.
        kubectl(kube, "delete", "-n", triton, "-f", str(policy), "--timeout=60s", timeout=90)
        assert set(gates(kube, triton).values()) == {"True"}
        # ... but a second one, which the operator has reconciled, is left behind (out of the
        # documented order): the operator put no finalizer on it.
        kubectl(
            kube,
            "apply",
            "-n",
            triton,
            "-f",
            "-",
            stdin=POLICY.replace("name: triton", "name: left", 1),
        )
        waiting.wait_for(
            "the left-behind policy reconciled",
            lambda: kubectl(kube, "get", "bp", "left", "-n", triton, "-o",
                            "jsonpath={.status.observedGeneration}") == "1",
            timeout=60,
        )  # fmt: skip
        assert kubectl(kube, "get", "bp", "left", "-n", triton, "-o",
                       "jsonpath={.metadata.finalizers}") == ""  # fmt: skip
        manifest = helm(kube, "get", "manifest", release, "-n", system)
        objects = release_objects(manifest)
        helm(kube, "uninstall", release, "-n", system, "--wait", "--timeout", "120s")
        assert still_there(kube, objects) == []
        waiting.wait_for(
            "nothing labelled as the release (its Pods, ReplicaSets, EndpointSlices)",
            lambda: not labelled_leftovers(kube, release),
            timeout=90,
            interval=2,
        )
        assert "sh.helm.release" not in kubectl(kube, "get", "secrets", "-n", system, "-o", "name")
        assert set(gates(kube, triton).values()) == {"True"}
        # With no operator left, deleting the left-behind policy, then its namespace, does not
        # hang (a finalizer would hold both until removed by hand).
        deleting = time.monotonic()
        kubectl(kube, "delete", "bp", "left", "-n", triton, "--timeout=20s", timeout=30)
        kubectl(kube, "delete", "namespace", triton, "--timeout=90s", timeout=100)
        print(
            f"policy and namespace deleted after the uninstall: {time.monotonic() - deleting:.1f} s"
        )
        # Kept by design: the CRDs (helm never deletes a chart's crds/), and the namespaces,
        # which the user made.
        kept = kubectl(kube, "get", "crd", "-o", "name").split()
        assert "customresourcedefinition.apiextensions.k8s.io/batchpolicies.batchpilot.dev" in kept
        print(f"left by design: {[k for k in kept if 'batchpilot' in k or 'kopf' in k]}")
        # The kubelet kept the advertised GPUs through all of it.
        assert gpu_resources(kube) == (str(GPUS), str(GPUS))
        print(f"the whole path: {time.monotonic() - began:.0f} s")
