"""Writing a BatchPolicy's status through the status subresource."""

from __future__ import annotations

from typing import Any

import kubernetes.client

from batchpilot.api import names, v1alpha1
from batchpilot.kube import calls

MERGE = "application/merge-patch+json"


class Policies:
    def __init__(self, api: kubernetes.client.ApiClient, *, timeout: float = 10.0) -> None:
        self._custom = kubernetes.client.CustomObjectsApi(api)
        self._timeout = timeout

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the status fields given (a merge patch: lists are written whole)."""
        await calls.bounded(
            self._custom.patch_namespaced_custom_object_status,
            names.GROUP,
            v1alpha1.VERSION,
            namespace,
            names.PLURAL,
            name,
            {"status": status},
            _content_type=MERGE,
            read_timeout=self._timeout,
        )
