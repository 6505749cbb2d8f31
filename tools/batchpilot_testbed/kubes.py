"""The cluster under test as the e2e tests see it: kubeconfig, context and API clients."""

import shutil
import subprocess
from pathlib import Path

import kubernetes.client
import kubernetes.config

from batchpilot_cluster import controlplane, locations


def current_context(kubeconfig: Path) -> str:
    # kubernetes.config ships without annotations, unlike kubernetes.client.
    _, current = kubernetes.config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig)
    )
    return str(current["name"])


class Kube:
    def __init__(self, *, kubeconfig: Path, context: str, local: controlplane.Cluster | None):
        self.kubeconfig = kubeconfig
        self.context = context
        self.local = local  # None when the tests run against someone else's test cluster
        self.api_client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig), context=context
        )
        self.core = kubernetes.client.CoreV1Api(self.api_client)
        self.apps = kubernetes.client.AppsV1Api(self.api_client)

    def kubectl(self, *args: str) -> str:
        """Run kubectl (ours if built, else the one on PATH) on this cluster; its output."""
        try:
            result = self.kubectl_run(*args)
        except FileNotFoundError:
            return "(no kubectl)"
        return result.stdout + result.stderr

    def kubectl_run(
        self, *args: str, stdin: str | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl on this cluster; the completed process, whatever its exit status."""
        ours = locations.bin_dir() / "kubectl"
        binary = str(ours) if ours.exists() else shutil.which("kubectl")
        if binary is None:
            raise FileNotFoundError("kubectl: neither built (make k8s-bins) nor on PATH")
        argv = [binary, f"--kubeconfig={self.kubeconfig}", f"--context={self.context}", *args]
        return subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
