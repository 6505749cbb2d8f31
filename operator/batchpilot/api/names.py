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

CONFIG_APPLIED_GATE = f"{GROUP}/config-applied"
"""The readiness gate of a Triton Pod: batchpilot holds its condition False while it switches
the Pod, so its Services stop sending it requests."""

INJECT_LABEL = f"{GROUP}/inject"
"""The opt-in label of a Pod template for the admission webhook: a Pod created with it gets what
batchpilot needs (`batchpilot.admission.injections`), GOVERNED_LABEL among it. The webhook's
objectSelector carries it, so the API server asks about no other Pod."""
INJECT_VALUE = "true"
INJECT_SELECTOR = f"{INJECT_LABEL}={INJECT_VALUE}"

TRITON_FLAGS_ANNOTATION = f"{GROUP}/triton-flags"
"""On an opted-in Pod template: which of Triton's flags the webhook adds, comma-separated
(`explicit-model-control`, `restricted-api`, `summary-latencies`)."""
TRITON_VERSION_ANNOTATION = f"{GROUP}/triton-version"
"""On an opted-in Pod template: the Triton version (`2.51`) where the image's tag does not say."""
REPOSITORY_CREDENTIAL_ANNOTATION = f"{GROUP}/repository-credential"
"""On an opted-in Pod template: the Secret (key `token`) whose value locks Triton's
model-repository API; the chart's default otherwise."""
INJECTED_ANNOTATION = f"{GROUP}/injected"
"""Set by the webhook on the Pods it changed: what it added, for `kubectl describe`."""
