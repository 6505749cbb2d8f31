"""Reading a policy's repository credential from a Secret in the policy's own namespace.

Only the policy's namespace, never another: a policy author can point the operator at no
Secret they could not name in their own namespace. The operator's RBAC narrows it further to
the Secret names the installation lists (the chart's `repositoryCredentials.secretNames`), so a
policy that names any other Secret is refused by the API server, and says so. The Secret is
read on every pass (one GET per policy per tick), so a rotated value is used at once.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import credentials
from batchpilot.kube.client import KubeClient, KubeError


class SecretCredentials:
    """`credentials.CredentialSource` over the Kubernetes API."""

    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def repository_headers(
        self, namespace: str, credential: specs.RepositoryCredential | None
    ) -> dict[str, str]:
        if credential is None:
            return {}
        where = f"Secret {namespace}/{credential.secret_name}"
        try:
            response: Any = await self._client.call(
                f"reading {where}",
                self._client.core.read_namespaced_secret,
                credential.secret_name,
                namespace,
                _preload_content=False,
            )
        except KubeError as error:
            raise credentials.CredentialUnavailable(_refusal(where, error)) from None
        data = (json.loads(response.data).get("data") or {}).get(credential.key)
        if data is None:
            raise credentials.CredentialUnavailable(f"{where} has no key {credential.key!r}")
        try:
            value = base64.b64decode(data, validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            value = ""
        return credentials.headers(
            credential.header, value, source=f"{where} key {credential.key!r}"
        )


def _refusal(where: str, error: KubeError) -> str:
    status = error.status
    if status is None:
        return f"reading {where} failed: {error.reason}"
    if status == 404:
        return f"{where} does not exist"
    if status == 403:
        return (
            f"the operator may not read {where}: it reads only the Secrets its installation "
            "names (the chart's repositoryCredentials.secretNames)"
        )
    return f"reading {where} failed (HTTP {status})"
