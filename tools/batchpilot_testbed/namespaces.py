"""A namespace of its own for each e2e test and benchmark run, and a clean end to it.

A new namespace takes no Pods until the controller manager has made its default service account,
so it is handed out only after that. At the end the namespace is deleted, and its Pods right after
it, without waiting for the namespace controller or for the kubelet to stop their containers
(a Triton takes up to its 5 s grace period): the kubelet frees a Pod's IP only once its sandbox
is gone, so the next test's Pods never meet a server still shutting down.
"""

import contextlib
import uuid
from collections.abc import Iterator

import kubernetes.client

from batchpilot_testbed import waiting
from batchpilot_testbed.kubes import Kube


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def created(
    kube: Kube,
    name: str,
    *,
    label: str,
    ready_timeout: float = 30.0,
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
        with contextlib.suppress(kubernetes.client.ApiException):
            kube.core.delete_namespace(name)
        # The namespace controller gets to the Pods seconds later; deleting them now (a
        # terminating namespace takes no new ones) saves those seconds on every test.
        with contextlib.suppress(kubernetes.client.ApiException):
            kube.core.delete_collection_namespaced_pod(name)
