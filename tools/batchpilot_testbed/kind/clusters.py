"""What the kind cluster of `python -m batchpilot_testbed.kind` is, for the tools and the tests:
its names, the networks the host routes through its node, where the node mounts the models."""

from typing import Final

from batchpilot_cluster import locations

CLUSTER: Final = "batchpilot"
CONTEXT: Final = f"kind-{CLUSTER}"
NODE: Final = f"{CLUSTER}-control-plane"
POD_SUBNET: Final = "10.244.0.0/16"
NODE_POD_RANGE: Final = "10.244.0.0/24"
"""The one node's podCIDR (the controller manager hands the first /24 of POD_SUBNET to the first
node); the node image's ptp CNI config allocates from it."""
SERVICE_SUBNET: Final = "10.97.0.0/16"
"""Apart from the local e2e cluster's Services (10.96.0.0/16) and pods (10.88.0.0/16), as
POD_SUBNET is."""
NETWORKS: Final = (POD_SUBNET, SERVICE_SUBNET)
"""What the host routes through the node: the tests reach Pods and Services as the operator
would inside the cluster."""
MODEL_REPOSITORY: Final = locations.REPO_ROOT / "manifests" / "model-repository"
MODEL_PATH: Final = "/batchpilot/model-repository"
"""Where the node mounts this checkout's model repository (read-only), for hostPath volumes."""


def is_kind(context: str) -> bool:
    return context == CONTEXT
