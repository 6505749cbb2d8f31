"""The admission webhook of an operator run as a host process, for the e2e tests.

The local cluster's API server runs on this host, so it reaches a webhook on 127.0.0.1: the
test makes a CA and a serving certificate for that address (`batchpilot_cluster.certificates`,
thrown away with the test's tmp dir), starts `batchpilot operator --webhook-listen ...` with
them, and creates a MutatingWebhookConfiguration as the chart's template renders it, but with
that URL and only the test's namespace in its namespaceSelector, so no other test's Pods are
sent to it. In the cluster the chart's Service and certificates play these parts.
"""

import base64
import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from cryptography.x509.oid import ExtendedKeyUsageOID

from batchpilot.admission import webhooks
from batchpilot.api import names
from batchpilot_cluster import certificates
from batchpilot_harness import local_triton
from batchpilot_testbed.kubes import Kube

ADDRESS = "127.0.0.1"
TIMEOUT_SECONDS = 2


def serving_certificates(directory: Path) -> bytes:
    """A CA, and a certificate it signs for ADDRESS, as tls.crt and tls.key in `directory`
    (the layout of a kubernetes.io/tls Secret); the CA's PEM, for the caBundle."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, key = certificates.new_key(), certificates.new_key()
    ca_name = certificates.name("batchpilot-e2e-webhook-ca")
    ca = certificates.issue(
        subject=ca_name, public_key=ca_key.public_key(), issuer=ca_name, issuer_key=ca_key,
        is_ca=True,
    )  # fmt: skip
    serving = certificates.issue(
        subject=certificates.name("batchpilot-webhook"), public_key=key.public_key(),
        issuer=ca_name, issuer_key=ca_key, usages=(ExtendedKeyUsageOID.SERVER_AUTH,),
        ip_addresses=(ADDRESS,),
    )  # fmt: skip
    certificates.write_key(directory / webhooks.PRIVATE_KEY, key)
    certificates.write_cert(directory / webhooks.CERTIFICATE, serving)
    certificates.write_cert(directory / "ca.crt", ca)
    return (directory / "ca.crt").read_bytes()


class HostWebhook:
    """Where the operator's webhook listens, and the arguments that make it listen there."""

    def __init__(self, directory: Path, *, sidecar_image: str, own_namespace: str) -> None:
        self.certificates = directory
        self.ca = serving_certificates(directory)
        (self.port,) = local_triton.free_ports(ADDRESS, 1)
        self.url = f"https://{ADDRESS}:{self.port}{webhooks.PATH}"
        self.arguments = [
            f"--webhook-listen={ADDRESS}:{self.port}",
            f"--webhook-certificates={directory}",
            f"--sidecar-image={sidecar_image}",
            "--sidecar-pull-policy=Never",  # imported into the node's runtime: no registry
            f"--own-namespace={own_namespace}",
        ]


def configuration(name: str, *, url: str, ca: bytes, namespace: str) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration, pointed at `url` and `namespace` only."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "inject.batchpilot.dev",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Ignore",
                "timeoutSeconds": TIMEOUT_SECONDS,
                "reinvocationPolicy": "IfNeeded",
                "matchPolicy": "Equivalent",
                "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                        "scope": "Namespaced",
                    }
                ],
                "objectSelector": {"matchLabels": {names.INJECT_LABEL: names.INJECT_VALUE}},
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": namespace},
                },
            }
        ],
    }


@contextlib.contextmanager
def configured(kube: Kube, document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The configuration created, and deleted at the end."""
    applied = kube.kubectl_run("apply", "-f", "-", stdin=yaml.safe_dump(document))
    assert applied.returncode == 0, applied.stderr
    try:
        yield copy.deepcopy(document)
    finally:
        name = document["metadata"]["name"]
        kube.kubectl_run("delete", "mutatingwebhookconfiguration", name, "--wait=false")
