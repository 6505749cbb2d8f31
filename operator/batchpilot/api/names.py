"""The API's names, the same in every version: group, kind, plural, short names."""

GROUP = "batchpilot.dev"
KIND = "BatchPolicy"
PLURAL = "batchpolicies"
SINGULAR = "batchpolicy"
SHORT_NAMES = ("bp",)
CRD_NAME = f"{PLURAL}.{GROUP}"
