"""A namespace of its own for each e2e test and benchmark run, and a clean end to it.

A new namespace takes no Pods until the controller manager has made its default service account,
so it is handed out only after that. Deleting it is not the end on the local cluster: the clean-up
waits until the kubelet of the real node has stopped the containers of the namespace's Pods there
(their Pod objects are gone once it has), so that the next test does not share the machine's two
cores with servers still shutting down. kwok's Pods run nothing and go at once. The Pods are
deleted right after the namespace, without waiting for the namespace controller.
"""

import contextlib
import uuid
from collections.abc import Iterator

import kubernetes.client

from e2e import waiting
from e2e.kubes import Kube


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def created(
    kube: Kube,
    name: str,
    *,
    label: str,
    ready_timeout: float = 30.0,
    release_timeout: float = 30.0,
) -> Iterator[str]:
    """The namespace `name`, labelled `label: "1"`, deleted at the end."""
    kube.core.create_namespace(
        kubernetes.client.V1Namespace(
            metadata=kubernetes.client.V1ObjectMeta(name=name, labels={label: "1"})
        )
    )

    def service_account_exists() -> bool:
        try:
            kube.core.read_namespaced_service_account("default", name)
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    waiting.wait_for(
        f"service account default in {name}", service_account_exists, timeout=ready_timeout
    )
    try:
        yield name
    finally:
        real_node = kube.local.node.name if kube.local else None
        running = {
            str(pod.metadata.name)
            for pod in kube.core.list_namespaced_pod(name).items
            if pod.metadata and pod.spec and real_node and pod.spec.node_name == real_node
        }
        with contextlib.suppress(kubernetes.client.ApiException):
            kube.core.delete_namespace(name)
        # The namespace controller gets to the Pods seconds later; deleting them now (a
        # terminating namespace takes no new ones) saves those seconds on every test.
        with contextlib.suppress(kubernetes.client.ApiException):
            kube.core.delete_collection_namespaced_pod(name)
        if running:
            waiting.wait_for(
                f"the kubelet to stop {', '.join(sorted(running))} of {name}",
                lambda: not kube.core.list_namespaced_pod(name).items,
                timeout=release_timeout,
            )
