"""BatchPolicy v1alpha1: the spec (`specs`) and the status (`status`) as the API server stores
them, and the operator writes them."""

from batchpilot.api import names

VERSION = "v1alpha1"
API_VERSION = f"{names.GROUP}/{VERSION}"
