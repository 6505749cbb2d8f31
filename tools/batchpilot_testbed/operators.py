"""The batchpilot operator as the e2e tests run it: a real process, as its own ServiceAccount.

The operator authenticates with a token of the `batchpilot-operator` ServiceAccount, bound to
the ClusterRole in `manifests/rbac.yaml`, so every e2e test also proves that role is enough.
"""

import contextlib
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml
from prometheus_client.parser import text_string_to_metric_families

from batchpilot import telemetry
from batchpilot.api import names, v1alpha1
from batchpilot_cluster import audit
from batchpilot_harness import local_triton
from batchpilot_testbed import watches
from batchpilot_testbed.kubes import Kube

REPO = Path(__file__).resolve().parents[2]
SERVICE_ACCOUNT = "batchpilot-operator"
SYSTEM_NAMESPACE = audit.AUDITED_NAMESPACE
"""The local cluster's audit log keeps the requests of this namespace's service accounts."""
USER = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{SERVICE_ACCOUNT}"
"""Who the operator is to the API server (and in its audit log)."""


def install_api(kube: Kube) -> None:
    """The CRDs from crds/ (Established) and the operator's RBAC from manifests/; one process
    at a time per cluster (the e2e suite's workers each install it when they start)."""
    digest = hashlib.sha1(str(kube.kubeconfig.resolve()).encode()).hexdigest()[:12]
    with (Path(tempfile.gettempdir()) / f"batchpilot-install-api-{digest}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _install_api(kube)


def _install_api(kube: Kube) -> None:
    for path in sorted((REPO / "crds").glob("*.yaml")):
        applied = kube.kubectl_run("apply", "--server-side", "-f", str(path))
        assert applied.returncode == 0, applied.stderr
    waited = kube.kubectl_run(
        "wait", "--for=condition=Established", "--timeout=30s", "crd", "--all"
    )
    assert waited.returncode == 0, waited.stderr
    created = kube.kubectl_run("create", "namespace", SYSTEM_NAMESPACE)
    assert created.returncode == 0 or "AlreadyExists" in created.stderr, created.stderr
    applied = kube.kubectl_run("apply", "-f", str(REPO / "manifests" / "rbac.yaml"))
    assert applied.returncode == 0, applied.stderr


def install_and_log_in(kube: Kube, kubeconfig: Path) -> Path:
    """The API installed (`install_api`), and `kubeconfig` written to log in as the operator's
    ServiceAccount; its path."""
    install_api(kube)
    return service_account_kubeconfig(kube, kubeconfig)


def service_account_kubeconfig(
    kube: Kube,
    path: Path,
    *,
    service_account: str = SERVICE_ACCOUNT,
    namespace: str = SYSTEM_NAMESPACE,
) -> Path:
    """A kubeconfig that is the operator's ServiceAccount, on the cluster under test."""
    token = kube.kubectl_run("create", "token", service_account, "-n", namespace, "--duration=6h")
    assert token.returncode == 0, token.stderr
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == kube.context)["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": service_account, "user": {"token": token.stdout.strip()}}],
        "contexts": [
            {
                "name": f"{service_account}@{kube.context}",
                "context": {"cluster": cluster["name"], "user": service_account},
            }
        ],
        "current-context": f"{service_account}@{kube.context}",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class OperatorProcess:
    """`batchpilot operator` in a process of its own, logging to a file."""

    def __init__(
        self,
        *,
        kubeconfig: Path,
        log_path: Path,
        namespaces: Sequence[str],
        interval: float = 2.0,
        standalone: bool = True,
        extra: Sequence[str] = (),
        code: Sequence[Path] = (),
    ) -> None:
        """`code`: folders whose packages shadow the installed product's (another revision's
        `operator/` and `sidecar/`, for running it side by side with this checkout)."""
        self.log_path = log_path
        self.metrics_port, self.liveness_port = local_triton.free_ports("127.0.0.1", 2)
        argv = [
            sys.executable, "-m", "batchpilot", "operator",
            "--interval", str(interval),
            "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
            *(["--standalone"] if standalone else []),
            *[argument for namespace in namespaces for argument in ("--namespace", namespace)],
            *extra,
        ]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        if code:
            env["PYTHONPATH"] = os.pathsep.join(str(folder) for folder in code)
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
        return False

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def decisions_made(self) -> float:
        """How many reconciles the operator has made: one decision each."""
        families = text_string_to_metric_families(self.metrics())
        return sum(
            sample.value
            for family in families
            if family.name == telemetry.DECISIONS.removesuffix("_total")
            for sample in family.samples
            if sample.name == telemetry.DECISIONS
        )

    def mean_reload_seconds(self) -> float | None:
        """The mean time its reloads took so far (batchpilot_apply_duration_seconds): what a
        request that reached a server in the middle of one waits on the order of. None before
        any. The machine's load sets it (1.7-1.9 s idle here, 7-8.5 beside a busy core)."""
        totals = {"_sum": 0.0, "_count": 0.0}
        for family in text_string_to_metric_families(self.metrics()):
            if family.name != telemetry.APPLY_DURATION:
                continue
            for sample in family.samples:
                suffix = sample.name.removeprefix(telemetry.APPLY_DURATION)
                if suffix in totals:
                    totals[suffix] += sample.value
        return totals["_sum"] / totals["_count"] if totals["_count"] else None

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a node loss would: no chance to clean up."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode


def apply_policy(kube: Kube, namespace: str, document: dict[str, Any]) -> None:
    applied = kube.kubectl_run("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(document))
    assert applied.returncode == 0, applied.stderr


def create_peering(kube: Kube, namespace: str, name: str = "batchpilot") -> None:
    """The KopfPeering through which operator replicas (not --standalone) elect one active."""
    peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name}}
    apply_policy(kube, namespace, peering)


def policy_status(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    got = kube.kubectl_run("get", "bp", name, "-n", namespace, "-o", "yaml")
    assert got.returncode == 0, got.stderr
    status: dict[str, Any] = (yaml.safe_load(got.stdout) or {}).get("status") or {}
    return status


@contextlib.contextmanager
def statuses_watched(kube: Kube, namespace: str, name: str) -> Iterator[list[dict[str, Any]]]:
    """Every status the policy has while the block runs, in order, from a watch started
    before it: states too short-lived for polling to catch (a rollout's first seconds) too."""
    seen: list[dict[str, Any]] = []

    def on_event(event: dict[str, Any]) -> None:
        status = (event["object"] or {}).get("status") or {}
        if status and (not seen or seen[-1] != status):
            seen.append(status)

    with watches.followed(
        kubernetes.client.CustomObjectsApi(kube.api_client).list_namespaced_custom_object,
        names.GROUP,
        v1alpha1.VERSION,
        namespace,
        names.PLURAL,
        field_selector=f"metadata.name={name}",
        on_event=on_event,
        what=f"{namespace}/{name}",
    ):
        yield seen


def canary_status(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """The policy's latest canary (status.canary), or {} before its first."""
    canary: dict[str, Any] = policy_status(kube, namespace, name).get("canary") or {}
    return canary


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    for item in status.get("conditions") or []:
        if item.get("type") == kind:
            return dict(item)
    return {}


def events(kube: Kube, namespace: str, reason: str) -> list[str]:
    listed = kube.core.list_namespaced_event(namespace).items
    return [e.message or "" for e in listed if e.reason == reason]


def now() -> float:
    return time.time()
