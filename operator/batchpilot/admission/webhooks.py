"""The admission webhook's I/O: kopf's HTTPS server and one mutating handler, both thin.

Every decision is `injections.inject`'s; this module only hands it the Pod of each admission
request and hands kopf its patch (or its refusal, which denies the Pod with the message).

The chart owns the MutatingWebhookConfiguration (kopf's `managed` mode would need the right to
create and patch every webhook configuration of the cluster): it sends only Pods that carry
`names.INJECT_LABEL`, at their creation, with `failurePolicy: Ignore` and a short timeout, so a
webhook that is down or slow delays no Pod and refuses none (a Pod created then is not
injected: see docs/how-to/join-existing-deployment.md). Its certificate is the chart's or
cert-manager's, mounted as `tls.crt` and `tls.key`; kopf re-reads the files when they change.
The handler keeps no state: every operator replica serves it, leader or not.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import kopf

from batchpilot.admission import injections

logger = logging.getLogger("batchpilot.admission")

HANDLER_ID = "inject"
"""kopf serves the handler at /<id>: the webhook configuration's path."""
PATH = f"/{HANDLER_ID}"
CERTIFICATE, PRIVATE_KEY = "tls.crt", "tls.key"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WebhookOptions:
    host: str
    port: int
    certificates: Path
    """A folder with tls.crt and tls.key (a mounted kubernetes.io/tls Secret)."""
    injection: injections.Settings


def check_certificates(folder: Path) -> None:
    """Fail at start, naming the file, rather than at the first admission request."""
    for name in (CERTIFICATE, PRIVATE_KEY):
        if not (folder / name).is_file():
            raise SystemExit(f"--webhook-certificates: no {name} in {folder}")


def server(options: WebhookOptions) -> kopf.WebhookServer:
    return kopf.WebhookServer(
        addr=options.host,
        port=options.port,
        certfile=options.certificates / CERTIFICATE,
        pkeyfile=options.certificates / PRIVATE_KEY,
    )


def register(registry: kopf.OperatorRegistry, options: WebhookOptions) -> None:
    """Add the mutating handler for Pod creations to kopf's registry."""
    settings = options.injection

    @kopf.on.mutate(
        "", "v1", "pods", id=HANDLER_ID, operations=["CREATE"], registry=registry,
        side_effects=False, ignore_failures=True,
    )  # fmt: skip
    async def inject(
        *, body: kopf.Body, patch: kopf.Patch, namespace: str | None, **_: Any
    ) -> None:
        try:
            injection = injections.inject(dict(body), settings, namespace=namespace)
        except injections.Refused as refusal:
            logger.warning("%s: Pod not admitted: %s", namespace, refusal)
            raise kopf.AdmissionError(str(refusal), code=400) from None
        if injection.patch:
            made = injection.pod
            patch.fns.append(lambda pod: _replace(pod, made))
            logger.info("%s: Pod injected: %s", namespace, ", ".join(injection.added))


def _replace(pod: Any, made: dict[str, Any]) -> None:
    """kopf diffs the body before and after its patch functions into the JSON patch it answers
    with: the injection's Pod, whole, gives exactly the injection's operations."""
    pod.clear()
    pod.update(made)
