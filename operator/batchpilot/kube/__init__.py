"""Kubernetes I/O for the operator: target Pods, their readiness gate, policy status."""
