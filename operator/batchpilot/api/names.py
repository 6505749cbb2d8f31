"""The API's names, the same in every version: group, kind, plural, short names."""

GROUP = "batchpilot.dev"
KIND = "BatchPolicy"
PLURAL = "batchpolicies"
SINGULAR = "batchpolicy"
SHORT_NAMES = ("bp",)
CRD_NAME = f"{PLURAL}.{GROUP}"

GOVERNED_LABEL = f"{GROUP}/governed"
"""The opt-in label of a Triton Pod: the operator watches only Pods that carry it, with the value
`GOVERNED_VALUE` (a server-side label selector), so its memory follows the Pods it governs, not
the cluster's. A policy's `spec.target.selector` then picks among those Pods."""
GOVERNED_VALUE = "true"
GOVERNED_SELECTOR = f"{GOVERNED_LABEL}={GOVERNED_VALUE}"

CRD_REVISION_ANNOTATION = f"{GROUP}/crd-revision"
"""On the CRD: a digest of its spec, so the chart can tell an installed CRD from another release
and refuse to upgrade over it (helm never upgrades a chart's crds/)."""
