"""batchpilot: policy-driven dynamic batching for NVIDIA Triton Inference Server.

The package is layered, and `.importlinter` keeps it so:

- `batchpilot.policy` is pure: the typed BatchPolicy model and the decision engine. It never
  touches the network, the clock or Kubernetes; time and signals are parameters.
- I/O modules (Triton, Kubernetes, Prometheus, sidecars) sit above it.
- Entry points (the kopf handlers, the standalone runner, the CLI) sit on top and stay thin.
"""

from batchpilot_triton import __version__

__all__ = ["__version__"]
