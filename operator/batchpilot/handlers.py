"""The kopf handlers: thin, they only unpack kopf's arguments and delegate to the Controller.

Importing this module registers them with kopf's default registry; `run` starts kopf with them.

No BatchPolicy carries a finalizer of batchpilot's. kopf would put one on every policy for its
daemon (it stops a daemon before letting the object go), and after an uninstall, or while the
operator is down, deleting a policy, or its namespace, would hang on it until someone removed it
by hand. Instead the policy's DELETED event ends its loop and opens the gates it left False
(`policy_changed`); a policy deleted while no operator ran leaves its Pods' gates as they were,
and the operator opens those no policy selects when it lists the Pods again (`pod_changed`).
kopf also takes the finalizer it put on policies before off them, as the first event of each
arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
from typing import Any

import kopf

from batchpilot import operating, telemetry
from batchpilot.admission import webhooks
from batchpilot.api import names, v1alpha1
from batchpilot.kube import client

GROUP, VERSION, PLURAL = names.GROUP, v1alpha1.VERSION, names.PLURAL
WATCH_PAGE_SIZE = 500


def controller_of(memo: Any) -> operating.Controller:
    controller: operating.Controller = memo["controller"]
    return controller


@kopf.on.login()
async def login(*, logger: kopf.Logger, **_: Any) -> kopf.ConnectionInfo:
    """kopf logs in as the operator's own client does (`kube.client.login`: in a Pod its
    ServiceAccount, else the kubeconfig), off the event loop and within a deadline
    (`kube.client.log_in`): one login for both."""
    async with asyncio.timeout(client.LOGIN_SECONDS):
        return await client.log_in(functools.partial(client.login, logger=logger))


@kopf.on.startup()
async def configure(*, settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # kopf's own bookkeeping goes into batchpilot.dev annotations; the status is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/operator"
    # No watching of CRDs and namespaces: fewer permissions, and the CRD is installed first.
    settings.scanning.disabled = True
    # Only the Pods that opted in (names.GOVERNED_LABEL) reach the operator at all: the API
    # server filters the watch, so nothing is kept, indexed or even parsed for the others, and
    # the operator's memory follows the fleet it governs, not the cluster's Pods.
    settings.watching.label_selectors["", "v1", "pods"] = names.GOVERNED_SELECTOR
    # The first LIST of a large fleet arrives in pages, never as one response held whole.
    settings.watching.chunk_size = WATCH_PAGE_SIZE
    webhook: webhooks.WebhookOptions | None = memo.get("webhook")
    if webhook is not None:
        # The chart owns the MutatingWebhookConfiguration: kopf only serves (see `webhooks`).
        settings.admission.server = webhooks.server(webhook)
    settings.posting.level = logging.INFO
    settings.peering.stealth = True
    if not controller_of(memo).options.verbose:
        # Every Pod event would log "Handler 'pod_changed' succeeded"; batchpilot logs what
        # matters under batchpilot.operator.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    controller = controller_of(memo)
    if controller.options.metrics_port is not None:
        memo["exporter"] = await telemetry.serve(
            controller.metrics.registry,
            host=controller.options.metrics_host,
            port=controller.options.metrics_port,
        )


@kopf.on.cleanup()
async def close(*, memo: Any, **_: Any) -> None:
    exporter = memo.get("exporter")
    if exporter is not None:
        await exporter.cleanup()
    await controller_of(memo).close()


# The index and event handlers are coroutines though they do no I/O: kopf runs plain functions in
# its thread pool, and every Pod and policy event would take a trip through it.
@kopf.index(GROUP, VERSION, PLURAL)
async def policies_by_namespace(
    *, namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[str | None, tuple[str, dict[str, Any]]]:
    """Which policies select which Pods, so a Pod change pokes only its policies."""
    return {namespace: (name, dict(spec.get("target", {}).get("selector", {})))}


@kopf.index(GROUP, VERSION, PLURAL)
async def governors_by_namespace(
    *, namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any
) -> dict[str | None, operating.GovernorEntry]:
    """Which policies select which Pods, and since when: the oldest of several governs a Pod."""
    created = meta.creation_timestamp or ""
    return {namespace: (name, created, dict(spec.get("target", {}).get("selector", {})))}


@kopf.index("", "v1", "pods")
async def pods_by_namespace(
    *, namespace: str | None, body: kopf.Body, **_: Any
) -> dict[str | None, dict[str, Any]]:
    """Every watched Pod, trimmed to what batchpilot reads: each pass finds its policy's
    replicas here instead of listing them from the API."""
    return {namespace: operating.pod_snapshot(body)}


@kopf.daemon(
    GROUP, VERSION, PLURAL, id="reconcile", cancellation_backoff=1.0, cancellation_timeout=10.0
)
async def reconcile(
    *,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: Any,
    **indices: Any,
) -> None:
    assert namespace is not None  # BatchPolicy is namespaced
    governors: kopf.Index[str | None, operating.GovernorEntry] = indices["governors_by_namespace"]
    controller_of(memo).attach_pods(indices["pods_by_namespace"])
    await controller_of(memo).follow(
        namespace=namespace, name=name, body=body, stopped=stopped, governors=governors
    )


def _without_finalizers(registry: kopf.OperatorRegistry) -> None:
    """kopf's daemons always ask for a finalizer; batchpilot's loop ends on the policy's
    DELETED event instead (see the module's docstring). kopf has no public switch for it, so
    the registered daemon handlers are replaced by copies that do not ask; a unit test fails
    if kopf would still add one."""
    spawning = registry._spawning
    spawning._handlers = [
        dataclasses.replace(handler, requires_finalizer=False)
        for handler in spawning.get_all_handlers()
    ]


_without_finalizers(kopf.get_default_registry())


@kopf.on.event(GROUP, VERSION, PLURAL)
async def policy_changed(
    *,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    event: kopf.RawEvent,
    memo: Any,
    **indices: Any,
) -> None:
    if not namespace:
        return
    if event.get("type") == "DELETED":
        # Its loop ends, then the gates it left False open: its Pods go back into their Services.
        controller_of(memo).attach_pods(indices["pods_by_namespace"])
        await controller_of(memo).policy_deleted(
            namespace=namespace, name=name, spec=dict(body.spec), uid=body.meta.uid
        )
    elif body.meta.get("generation") != body.status.get("observedGeneration"):
        controller_of(memo).poke(namespace, name)


@kopf.on.event("", "v1", "pods")
async def pod_changed(
    *,
    namespace: str | None,
    body: kopf.Body,
    event: kopf.RawEvent,
    memo: Any,
    **indices: Any,
) -> None:
    index: kopf.Index[str | None, tuple[str, dict[str, Any]]] = indices["policies_by_namespace"]
    if namespace:
        controller_of(memo).pod_changed(
            namespace=namespace, pod=body, event_type=event.get("type"), index=index
        )
        if event.get("type") == "DELETED":
            await controller_of(memo).pod_left(namespace=namespace, pod=body)
        else:
            await controller_of(memo).open_if_ungoverned(namespace=namespace, pod=body, index=index)


def run(
    *,
    options: operating.Options,
    webhook: webhooks.WebhookOptions | None = None,
    namespaces: list[str],
    standalone: bool,
    peering: str,
    priority: int | None,
    liveness: str | None,
) -> int:
    """Run the operator until SIGTERM or Ctrl-C; with `webhook`, serve the admission webhook
    too."""
    controller = operating.build_controller(options)
    if webhook is not None:
        webhooks.register(kopf.get_default_registry(), webhook)
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=standalone,
        # Naming a peering makes it mandatory, which a standalone operator must not wait for.
        peering_name=None if standalone else peering,
        # Peers of equal priority all pause; a random one per replica makes one the leader.
        priority=priority if priority is not None else secrets.randbelow(2**31 - 1) + 1,
        liveness_endpoint=liveness,
        memo=kopf.Memo(controller=controller, webhook=webhook),
    )
    return 0
