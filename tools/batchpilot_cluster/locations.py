"""Where the test cluster keeps things: binaries in a per-user cache, run state in the repo.

Binaries take many minutes to build and do not depend on the checkout, so they live outside it,
keyed by Kubernetes version. Run state (certificates, kubeconfig, logs, pids) belongs to one
checkout and sits under the gitignored ``.run/``.
"""

import os
from pathlib import Path

from batchpilot_cluster import versions

REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    configured = os.environ.get("BATCHPILOT_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "batchpilot"


def version_root(version: str = versions.KUBERNETES) -> Path:
    return cache_root() / "k8s" / version


def bin_dir(version: str = versions.KUBERNETES) -> Path:
    return version_root(version) / "bin"


def state_dir() -> Path:
    configured = os.environ.get("BATCHPILOT_E2E_STATE")
    return Path(configured).resolve() if configured else REPO_ROOT / ".run" / "cluster"
