"""The Helm chart on a real API server: the helm that `python -m batchpilot_cluster build` makes,
and the monitoring CRDs the chart's objects need there.

The generated files (`manifests/install.yaml` and `manifests/rbac.yaml` among them) are written by
`make generate` (batchpilot_charts) and checked by tests/test_generated.py. The Prometheus
Operator CRDs come from that project's published Go module, pinned like the control plane.
"""

import json
import subprocess
from pathlib import Path

from batchpilot_charts import manifests
from batchpilot_cluster import building, locations, versions

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchpilot"
INSTALL = REPO / "manifests" / "install.yaml"
MONITORING_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")


def helm_binary() -> Path:
    return locations.bin_dir() / "helm"


def helm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run helm; the completed process, whatever its exit status."""
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def template(*args: str, namespace: str = manifests.NAMESPACE) -> str:
    return manifests.template(helm_binary(), CHART, *args, namespace=namespace)


def monitoring_crds() -> list[Path]:
    """ServiceMonitor, PodMonitor and PrometheusRule CRDs of the pinned Prometheus Operator."""
    env = building.go_environment()
    module = f"github.com/prometheus-operator/prometheus-operator@{versions.PROMETHEUS_OPERATOR}"
    downloaded = subprocess.run(
        ["go", "mod", "download", "-json", module],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=locations.cache_root(),
        timeout=600,
    )
    source = Path(json.loads(downloaded.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    return [source / f"monitoring.coreos.com_{plural}.yaml" for plural in MONITORING_CRDS]
