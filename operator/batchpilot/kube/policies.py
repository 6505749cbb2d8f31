"""A BatchPolicy's status, written in one place: through the status subresource, as one merge
patch of the fields that changed, with what the loop knows of the status kept in step."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from batchpilot.api import names, v1alpha1
from batchpilot.kube.client import KubeClient, KubeError, namespaced

logger = logging.getLogger("batchpilot.operator")

MERGE = "application/merge-patch+json"
API = f"{names.GROUP}/{v1alpha1.VERSION}"


class Policies:
    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def write_status(
        self, namespace: str, name: str, known: Mapping[str, Any], wanted: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """Write `wanted`'s fields if any differs from the `known` status: the status as it
        stands afterwards (what the next pass starts from; kopf's copy catches up only when the
        watch delivers the write), or None if the write failed (then kopf's copy is used)."""
        if not changed(known, wanted):
            return known
        try:
            await self.patch_status(namespace, name, dict(wanted))
        except KubeError as error:
            logger.warning("%s/%s: status not written: %s", namespace, name, error.reason)
            return None
        return merge_patch(known, wanted)

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the status fields given (a merge patch: lists are written whole)."""
        await self._client.request(
            f"writing the status of {names.KIND} {namespace}/{name}",
            "PATCH",
            namespaced(API, namespace, names.PLURAL, name, "status"),
            body={"status": status},
            content_type=MERGE,
        )


def merge_patch(target: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """`target` after a JSON merge patch (RFC 7386): objects merge, null deletes, the rest and
    lists are replaced."""
    merged = dict(target)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_patch(merged[key], value)
        else:
            merged[key] = value
    return merged


def changed(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    return any(current.get(key) != value for key, value in wanted.items())
