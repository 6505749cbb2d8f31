"""A kubelet stand-in that really runs the few kwok pods which ask for it.

kwok makes pods Running with an IP from their node's podCIDR, but nothing runs in them. The
operator under test must reach a real Triton at the pod's IP, so this watches pods on the
cluster's kwok nodes and, for those annotated ``batchpilot.dev/e2e-runtime: <runtime>``, gives the
pod a network namespace holding its IP (``podnetwork``) and starts the runtime's processes inside
it, listening on every address as in a container; when the pod is deleted it stops them (SIGTERM,
then SIGKILL, like a kubelet's grace period) and removes the namespace.

What runs is chosen only from ``RUNTIMES``, a fixed table of argv builders: annotations select a
row and pass model names, which must match ``MODEL_NAME``; nothing from a pod reaches a shell or
becomes a command. Pod IPs outside the cluster's pod CIDRs are refused, so a pod cannot make this
process route, or later delete, any other address of the host.

Not emulated: readiness probes, container restarts in the pod's status, logs through the API.
"""

import argparse
import base64
import contextlib
import dataclasses
import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import FrameType

from batchpilot_triton import endpoints
from e2e.cluster import controlplane, locations, podnetwork, processes, rest

RUNTIME_ANNOTATION = "batchpilot.dev/e2e-runtime"
MODELS_ANNOTATION = "batchpilot.dev/e2e-models"
GRPC_AGE_ANNOTATION = "batchpilot.dev/e2e-grpc-max-connection-age-ms"
"""Triton ends each gRPC connection after about this long (`local_triton`'s
`--grpc-max-connection-age-ms`): 100 to 600000."""
REPOSITORY_HEADER_ANNOTATION = "batchpilot.dev/e2e-repository-header"
"""Triton locks its model-repository API to this header, as manifests/triton-deployment.yaml
does; the value comes, as there, from the triton container's environment variable
TRITON_REPOSITORY_TOKEN, which must come from a Secret (`valueFrom.secretKeyRef`): the runner
reads it from the API as a kubelet would."""
REPOSITORY_TOKEN_VARIABLE = "TRITON_REPOSITORY_TOKEN"
HEADER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,62}[a-z0-9])?")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MAX_MODELS = 8
STOP_TIMEOUT = 10.0
WATCH_SECONDS = 5  # also how often exited processes are noticed and restarted
RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)

# Every pod has its own network, so its servers listen on fixed ports: Triton and the sidecar on
# their defaults (batchpilot_triton.endpoints), as in the chart; the http-echo stand-in on this.
ECHO_PORT = 8000
MODEL_REPOSITORY = locations.REPO_ROOT / "manifests" / "model-repository"


class RejectedPod(Exception):
    """The pod asks for something the runner will not do; reported as a Warning event."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodRequest:
    uid: str
    namespace: str
    name: str
    ip: str
    runtime: str
    models: tuple[str, ...]
    grace_seconds: float
    grpc_max_connection_age_ms: int | None = None
    repository_header: str | None = None
    repository_secret: tuple[str, str] | None = None
    """(Secret, key) of the header's value, in the pod's namespace."""

    @property
    def key(self) -> str:
        return f"{self.namespace}_{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """One process of a pod, like one container."""

    container: str
    argv: tuple[str, ...]
    cwd: Path | None = None
    secret_environment: tuple[tuple[str, str, str], ...] = ()
    """(variable, Secret, key): variables whose values the runner reads from Secrets."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workspace:
    """Where a pod's processes may keep files: a fresh folder per pod in the state dir."""

    directory: Path


CommandBuilder = Callable[[PodRequest, Workspace], tuple[Command, ...]]


def http_echo_commands(pod: PodRequest, workspace: Workspace) -> tuple[Command, ...]:
    """A stand-in server that answers GET / with the pod's namespace/name."""
    www = workspace.directory / "www"
    www.mkdir(parents=True, exist_ok=True)
    (www / "index.html").write_text(f"{pod.namespace}/{pod.name}\n")
    argv = (
        sys.executable, "-m", "http.server",
        "--bind", endpoints.EVERY_ADDRESS, "--directory", str(www), str(ECHO_PORT),
    )  # fmt: skip
    return (Command(container="main", argv=argv),)


def triton_commands(pod: PodRequest, workspace: Workspace) -> tuple[Command, ...]:
    argv = [
        sys.executable,
        "-m",
        "batchpilot_harness.local_triton",
        "--host",
        endpoints.EVERY_ADDRESS,
        "--http-port",
        str(endpoints.TRITON_HTTP_PORT),
        "--grpc-port",
        str(endpoints.TRITON_GRPC_PORT),
        "--metrics-port",
        str(endpoints.TRITON_METRICS_PORT),
        "--model-repository",
        str(MODEL_REPOSITORY),
    ]
    for model in pod.models:
        argv += ["--model", model]
    if pod.grpc_max_connection_age_ms is not None:
        argv += ["--grpc-max-connection-age-ms", str(pod.grpc_max_connection_age_ms)]
    secrets: tuple[tuple[str, str, str], ...] = ()
    if pod.repository_header is not None and pod.repository_secret is not None:
        argv += ["--repository-header", pod.repository_header]
        secrets = ((REPOSITORY_TOKEN_VARIABLE, *pod.repository_secret),)
    # The batchpilot sidecar beside it, as in the chart's example Deployment.
    sidecar = (
        sys.executable,
        "-m",
        "batchpilot_sidecar",
        "--triton-url",
        f"http://127.0.0.1:{endpoints.TRITON_HTTP_PORT}",
        "--listen",
        f"{endpoints.EVERY_ADDRESS}:{endpoints.SIDECAR_PORT}",
        # Rates over 5 s rather than 10: the e2e bursts last seconds.
        "--rate-window",
        "5",
    )
    return (
        Command(
            container="triton",
            argv=tuple(argv),
            cwd=workspace.directory,
            secret_environment=secrets,
        ),
        Command(container="batchpilot-sidecar", argv=sidecar, cwd=workspace.directory),
    )


def hostile_commands(pod: PodRequest, workspace: Workspace) -> tuple[Command, ...]:
    """A tenant's Pod that floods the operator's reads and trickles a Prometheus answer
    (`e2e.hostile_servers`)."""
    argv = (sys.executable, "-m", "e2e.hostile_servers", "--host", endpoints.EVERY_ADDRESS)
    return (Command(container="main", argv=argv, cwd=locations.REPO_ROOT),)


# A runtime may run several processes (Triton and its sidecar): one Command each.
RUNTIMES: Mapping[str, CommandBuilder] = {
    "http-echo": http_echo_commands,
    "triton": triton_commands,
    "hostile": hostile_commands,
}


def parse_models(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    models = tuple(part.strip() for part in text.split(","))
    if len(models) > MAX_MODELS:
        raise RejectedPod(f"{MODELS_ANNOTATION} lists more than {MAX_MODELS} models")
    for model in models:
        if not MODEL_NAME.fullmatch(model):
            raise RejectedPod(f"{MODELS_ANNOTATION}: {model!r} is not a model name")
    return models


def parse_grpc_age(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or not 100 <= int(text) <= 600_000:
        raise RejectedPod(f"{GRPC_AGE_ANNOTATION}: {text!r} is not 100 to 600000 (ms)")
    return int(text)


def parse_repository_credential(
    header: str | None, spec: rest.JsonObject
) -> tuple[str | None, tuple[str, str] | None]:
    """The header Triton's repository API is locked to, and the Secret its value comes from."""
    if header is None:
        return None, None
    if not HEADER_NAME.fullmatch(header):
        raise RejectedPod(f"{REPOSITORY_HEADER_ANNOTATION}: {header!r} is not a header name")
    for container in spec.get("containers") or []:
        for variable in container.get("env") or []:
            reference = (variable.get("valueFrom") or {}).get("secretKeyRef")
            if variable.get("name") == REPOSITORY_TOKEN_VARIABLE and reference:
                return header, (str(reference["name"]), str(reference["key"]))
    raise RejectedPod(
        f"{REPOSITORY_HEADER_ANNOTATION} needs {REPOSITORY_TOKEN_VARIABLE} from a secretKeyRef"
    )


def pod_request(
    pod: rest.JsonObject,
    *,
    nodes: Sequence[str],
    networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network],
) -> PodRequest | None:
    """What should run for this pod now; None for pods that are not ours or not running."""
    metadata = pod.get("metadata", {})
    annotations = metadata.get("annotations") or {}
    runtime = annotations.get(RUNTIME_ANNOTATION)
    spec = pod.get("spec", {})
    status = pod.get("status", {})
    if runtime is None or spec.get("nodeName") not in nodes:
        return None
    if metadata.get("deletionTimestamp") or status.get("phase") not in ("Pending", "Running"):
        return None
    ip = status.get("podIP")
    if not ip:
        return None
    if runtime not in RUNTIMES:
        raise RejectedPod(f"{RUNTIME_ANNOTATION}: unknown runtime {runtime!r}")
    if spec.get("hostNetwork"):
        raise RejectedPod("hostNetwork pods cannot get an address of their own")
    address = ipaddress.ip_address(ip)
    if not any(address in network for network in networks):
        raise RejectedPod(f"pod IP {ip} is outside the pod CIDRs")
    header, secret = parse_repository_credential(
        annotations.get(REPOSITORY_HEADER_ANNOTATION), spec
    )
    return PodRequest(
        uid=metadata["uid"],
        namespace=metadata["namespace"],
        name=metadata["name"],
        ip=str(address),
        runtime=runtime,
        models=parse_models(annotations.get(MODELS_ANNOTATION)),
        grace_seconds=float(spec.get("terminationGracePeriodSeconds", STOP_TIMEOUT)),
        grpc_max_connection_age_ms=parse_grpc_age(annotations.get(GRPC_AGE_ANNOTATION)),
        repository_header=header,
        repository_secret=secret,
    )


@dataclasses.dataclass(kw_only=True)
class RunningProcess:
    command: Command
    process: subprocess.Popen[bytes]
    restarts: int = 0
    restart_at: float | None = None  # when an exited process is due to start again


@dataclasses.dataclass(kw_only=True)
class RunningPod:
    request: PodRequest
    processes: list[RunningProcess]


class Runner:
    def __init__(self, cluster: controlplane.Cluster) -> None:
        self.cluster = cluster
        self.client = cluster.client()
        self.networks = [ipaddress.ip_network(cidr) for cidr in cluster.pod_cidrs]
        self.pods: dict[str, rest.JsonObject] = {}  # uid -> last seen pod
        self.running: dict[str, RunningPod] = {}
        self.rejected: dict[str, str] = {}  # uid -> last problem reported, to report it once

    def log(self, message: str) -> None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S.%f")[:-3]
        print(f"{stamp} {message}", flush=True)

    def event(self, pod: rest.JsonObject, *, reason: str, message: str, warning: bool) -> None:
        metadata = pod["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: rest.JsonObject = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "generateName": f"{metadata['name']}.",
                "namespace": metadata["namespace"],
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": metadata["name"],
                "namespace": metadata["namespace"],
                "uid": metadata["uid"],
            },
            "reason": reason,
            "message": message[:1000],
            "type": "Warning" if warning else "Normal",
            "source": {"component": "batchpilot-e2e-podrunner"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(rest.ApiError, OSError):
            self.client.request(
                "POST", f"/api/v1/namespaces/{metadata['namespace']}/events", body=body
            )

    # -- processes

    def spawn(self, pod: PodRequest, command: Command) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # Pods run the checkout's code, which the venv may not have installed.
        source_roots = [locations.REPO_ROOT / "operator", locations.REPO_ROOT / "sidecar"]
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, source_roots), *filter(None, [env.get("PYTHONPATH")])]
        )
        env["POD_NAME"] = pod.name
        env["POD_NAMESPACE"] = pod.namespace
        env["POD_IP"] = pod.ip
        for variable, secret, key in command.secret_environment:
            env[variable] = self.secret_value(pod.namespace, secret, key)
        return processes.start(
            name=f"pod-{pod.key}-{command.container}",
            argv=podnetwork.Host(ip=pod.ip).exec_argv(command.argv),
            state_dir=self.cluster.state_dir,
            log_path=self.cluster.logs_dir / "pods" / f"{pod.key}_{command.container}.log",
            env=env,
            cwd=command.cwd,
        )

    def secret_value(self, namespace: str, secret: str, key: str) -> str:
        """A Secret's value, as a kubelet puts it into a container's environment; a Secret or
        key that is missing stops the pod's start (retried, reported once)."""
        try:
            found = self.client.get(f"/api/v1/namespaces/{namespace}/secrets/{secret}")
        except rest.ApiError as error:
            raise OSError(f"Secret {namespace}/{secret}: {error}") from None
        data = (found.get("data") or {}).get(key)
        if data is None:
            raise OSError(f"Secret {namespace}/{secret} has no key {key!r}")
        return base64.b64decode(data).decode()

    def start_pod(self, pod: rest.JsonObject, request: PodRequest) -> None:
        workspace = Workspace(directory=self.cluster.state_dir / "pods" / request.uid)
        workspace.directory.mkdir(parents=True, exist_ok=True)
        commands = RUNTIMES[request.runtime](request, workspace)
        podnetwork.add_host(request.ip, routes=controlplane.HOST_ROUTES)
        started = [RunningProcess(command=c, process=self.spawn(request, c)) for c in commands]
        self.running[request.uid] = RunningPod(request=request, processes=started)
        pids = ", ".join(f"{p.command.container}={p.process.pid}" for p in started)
        self.log(f"started {request.key} ({request.runtime}) on {request.ip}: {pids}")
        self.event(
            pod, reason="E2EStarted", message=f"{request.runtime} on {request.ip}", warning=False
        )

    def stop_pods(self, uids: Collection[str]) -> None:
        """Stop the Pods' processes all at once, each within its Pod's grace period."""
        stopping = [self.running.pop(uid) for uid in uids]
        processes.stop_groups(
            {
                item.process.pid: min(pod.request.grace_seconds, STOP_TIMEOUT)
                for pod in stopping
                for item in pod.processes
            },
            state_dir=self.cluster.state_dir,
        )
        for pod in stopping:
            for item in pod.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    item.process.wait(timeout=1)
            if not any(r.request.ip == pod.request.ip for r in self.running.values()):
                podnetwork.remove_host(pod.request.ip)
            self.log(f"stopped {pod.request.key}; released {pod.request.ip}")

    def check_processes(self) -> None:
        """Restart exited processes with a growing delay, like a container in CrashLoopBackOff."""
        now = time.monotonic()
        for uid, running in self.running.items():
            for item in running.processes:
                code = item.process.poll()
                if code is None:
                    continue
                if item.restart_at is None:
                    delay = RESTART_BACKOFF[min(item.restarts, len(RESTART_BACKOFF) - 1)]
                    item.restart_at = now + delay
                    message = (
                        f"{item.command.container} exited with {code}; restart in {delay:.0f} s"
                    )
                    self.log(f"{running.request.key}: {message}")
                    if uid in self.pods:
                        self.event(
                            self.pods[uid], reason="E2EProcessExited", message=message, warning=True
                        )
                elif now >= item.restart_at:
                    item.process = self.spawn(running.request, item.command)
                    item.restarts += 1
                    item.restart_at = None
                    self.log(f"{running.request.key}: restarted {item.command.container}")

    # -- reconciliation

    def reconcile(self) -> None:
        desired: dict[str, tuple[rest.JsonObject, PodRequest]] = {}
        for uid, pod in self.pods.items():
            try:
                request = pod_request(pod, nodes=self.cluster.nodes, networks=self.networks)
            except RejectedPod as error:
                if self.rejected.get(uid) != str(error):
                    self.rejected[uid] = str(error)
                    metadata = pod["metadata"]
                    self.log(f"rejected {metadata['namespace']}/{metadata['name']}: {error}")
                    self.event(pod, reason="E2ERejected", message=str(error), warning=True)
                continue
            if request is not None:
                desired[uid] = (pod, request)
        stale = [
            uid
            for uid, running in self.running.items()
            if uid not in desired or desired[uid][1] != running.request
        ]
        self.stop_pods(stale)
        for uid, (pod, request) in desired.items():
            if uid not in self.running:
                try:
                    self.start_pod(pod, request)
                except OSError as error:  # retried at every turn; reported once
                    if self.rejected.get(uid) != str(error):
                        self.rejected[uid] = str(error)
                        self.log(f"cannot start {request.key}: {error}")
                        self.event(pod, reason="E2EFailed", message=str(error), warning=True)
        self.rejected = {uid: reason for uid, reason in self.rejected.items() if uid in self.pods}
        self.check_processes()

    def relist(self) -> str:
        listing = self.client.get("/api/v1/pods")
        self.pods = {pod["metadata"]["uid"]: pod for pod in listing.get("items", [])}
        return str(listing["metadata"]["resourceVersion"])

    def run(self, ready_marker: Path) -> None:
        resource_version = self.relist()
        self.reconcile()
        ready_marker.touch()
        self.log(f"watching pods on {', '.join(self.cluster.nodes)}")
        while True:
            try:
                for event in self.client.watch(
                    "/api/v1/pods", resource_version=resource_version, timeout_seconds=WATCH_SECONDS
                ):
                    kind, pod = event["type"], event["object"]
                    if kind == "ERROR":
                        raise rest.ApiError(int(pod.get("code", 500)), str(pod.get("message")))
                    resource_version = pod["metadata"]["resourceVersion"]
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        self.pods.pop(pod["metadata"]["uid"], None)
                    else:
                        self.pods[pod["metadata"]["uid"]] = pod
                    self.reconcile()
                self.reconcile()
            except (rest.ApiError, OSError, ValueError) as error:
                # 410 Gone (history compacted) or a dropped connection: start over from a list.
                self.log(f"watch ended ({error}); relisting")
                time.sleep(1)
                with contextlib.suppress(rest.ApiError, OSError, ValueError):
                    resource_version = self.relist()
                    self.reconcile()

    def stop_all(self) -> None:
        self.stop_pods(list(self.running))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminate)
    state_dir = args.state_dir.resolve()
    lock = podnetwork.try_lock(state_dir)
    if lock is None:
        print(f"the pod network is in use by the cluster in {podnetwork.holder()}", flush=True)
        return 1
    runner = Runner(controlplane.Cluster.load(state_dir))
    try:
        runner.run(state_dir / "podrunner.ready")
    except KeyboardInterrupt:
        pass
    finally:
        # A second signal must not cut the cleanup short and leave processes and addresses.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        runner.stop_all()
        lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
