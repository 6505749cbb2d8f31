"""A local Kubernetes control plane for the e2e tests, built from Go modules, with kwok nodes.

No Docker engine runs on the machines this project is developed on, so kind cannot start a cluster
there. This package builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
once per version into a cache, runs them as plain processes on loopback, with kwok's nodes for
Pods that only need to exist and one real node (``realnodes``: containerd and a kubelet, built
from their Go modules) for the Pods that must really run. With Docker, kind remains the way.
"""

from batchpilot_cluster.controlplane import Cluster, ClusterError, running, start, stop

__all__ = ["Cluster", "ClusterError", "running", "start", "stop"]
