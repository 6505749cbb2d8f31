"""Writing a BatchPolicy's status through the status subresource."""

from __future__ import annotations

from typing import Any

from batchpilot.api import names, v1alpha1
from batchpilot.kube.client import KubeClient

MERGE = "application/merge-patch+json"


class Policies:
    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the status fields given (a merge patch: lists are written whole)."""
        await self._client.call(
            f"writing the status of {names.KIND} {namespace}/{name}",
            self._client.custom.patch_namespaced_custom_object_status,
            names.GROUP,
            v1alpha1.VERSION,
            namespace,
            names.PLURAL,
            name,
            {"status": status},
            _content_type=MERGE,
        )
