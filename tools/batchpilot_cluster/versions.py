"""The one place where the versions of the test control plane (and of the test Grafana) are pinned.

Kubernetes is built from its Go modules, so any release the module proxy has can be used; the pin
is the newest minor whose ``go`` directive our Go toolchain satisfies. etcd follows the 3.6 line
that this release pins in ``build/dependencies.yaml``; Debian's 3.4 is older than it supports.
"""

from typing import Final

KUBERNETES: Final = "v1.36.3"
ETCD: Final = "v3.6.16"
KWOK: Final = "v0.8.0"
HELM: Final = "v3.22.0"
CONTAINERD: Final = "v2.4.2"
"""The real node's CRI runtime: a 1.36 kubelet wants containerd 2.x, which Debian 12 does not
package (its 1.6 is too old). The newest release whose go directive (1.26.6) our Go satisfies;
its go.mod has no replace directives, so it builds as a dependency."""
CRI_TOOLS: Final = "v1.37.0"
"""crictl, to look at the node's pods and containers by hand (the CRI API it speaks is stable
across minors; the proxy has no 1.36 release of cri-tools)."""
PROMETHEUS_OPERATOR: Final = "v0.85.0"
"""Only its CRDs (ServiceMonitor, PodMonitor, PrometheusRule), for the chart's monitoring."""
GRAFANA: Final = "v1.9.2-0.20230609164553-81d85ce8028d"
"""Grafana's server, for the dashboard and alert tests: the module github.com/grafana/grafana at
main commit 81d85ce8028d of 2023-06-09 (package.json: 10.0.0-preview). Its release tags are not
module versions (no /v10 suffix), so only pseudo-versions exist, and the module proxy these
machines reach refuses newer ones it was asked for (13.2.3's release commit, a main commit of
2026-09-16: 403 "This module version is not available")."""
WIRE: Final = "v0.6.0"
WIRE_GO_TOOLS: Final = "v0.41.0"
"""Google's wire generates Grafana's dependency injection (pkg/server/wire_gen.go is not in the
module); it is built with this golang.org/x/tools, since the one Grafana pins (v0.7.0) crashes
inside go/types of a current Go."""
