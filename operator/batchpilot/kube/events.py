"""Events on a policy, posted through the operator's one client (`kube.client`).

An Event is news, not state: one that cannot be posted is logged and dropped, and the pass that
made it goes on. Posted as kopf posts its own (the same fields, so `kubectl describe` shows them
alike), with batchpilot as the reporting component.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any, Literal

from batchpilot.kube.client import KubeClient, KubeError, namespaced

logger = logging.getLogger("batchpilot.operator")

COMPONENT = "batchpilot"
MAX_MESSAGE_LENGTH = 1024


EventType = Literal["Normal", "Warning"]


def event_body(
    involved: Mapping[str, Any],
    now: datetime.datetime,
    *,
    type: EventType,  # noqa: A002 - the Event's own field name
    reason: str,
    message: str,
) -> dict[str, Any]:
    """The core/v1 Event about the object whose body is `involved`."""
    metadata = involved.get("metadata") or {}
    stamp = now.astimezone(datetime.UTC).isoformat()
    return {
        "metadata": {"namespace": metadata.get("namespace"), "generateName": f"{COMPONENT}-"},
        "type": type,
        "reason": reason,
        "message": message[:MAX_MESSAGE_LENGTH],
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "source": {"component": COMPONENT},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "uid": metadata.get("uid"),
        },
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class Events:
    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def post(
        self,
        involved: Mapping[str, Any],
        *,
        type: EventType,  # noqa: A002 - the Event's own field name
        reason: str,
        message: str,
    ) -> None:
        now = datetime.datetime.now(datetime.UTC)
        body = event_body(involved, now, type=type, reason=reason, message=message)
        namespace = body["metadata"]["namespace"]
        try:
            await self._client.request(
                f"posting a {reason} event in {namespace}",
                "POST",
                namespaced("v1", namespace, "events"),
                body=body,
            )
        except KubeError as error:
            logger.warning("event not posted (%s): %s", error, message[:200])
