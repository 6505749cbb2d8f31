"""The one place where the versions of the test control plane are pinned.

Kubernetes is built from its Go modules, so any release the module proxy has can be used; the pin
is the newest minor whose ``go`` directive our Go toolchain satisfies. etcd follows the 3.6 line
that this release pins in ``build/dependencies.yaml``; Debian's 3.4 is older than it supports.
"""

from typing import Final

KUBERNETES: Final = "v1.36.3"
ETCD: Final = "v3.6.16"
KWOK: Final = "v0.8.0"
HELM: Final = "v3.22.0"
PROMETHEUS_OPERATOR: Final = "v0.85.0"
"""Only its CRDs (ServiceMonitor, PodMonitor, PrometheusRule), for the chart's monitoring."""
