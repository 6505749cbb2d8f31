"""Reading a policy's repository credential from a Secret in the policy's own namespace.

Only the policy's namespace, never another: a policy author can point the operator at no
Secret they could not name in their own namespace. The operator's RBAC narrows it further to
the Secret names the installation lists (the chart's `repositoryCredentials.secretNames`), so a
policy that names any other Secret is refused by the API server, and says so.

A value read is kept for `CACHE_SECONDS` (per namespace, Secret and key), so the policies of
every tenant do not each send a GET on every pass through the pool of threads they share; a
value Triton refuses is forgotten at once (`forget`), so a rotated Secret is taken on the next
pass after Triton refuses the old value, and within CACHE_SECONDS in any case. (Watching the
Secrets would need `list` and `watch` on them, which the operator's RBAC does not grant.)
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import credentials
from batchpilot.kube.client import KubeClient, KubeError, namespaced

CACHE_SECONDS = 30.0
"""How long a value read from a Secret is used before it is read again."""
CACHED_AT_MOST = 1024
"""Values kept at once (the oldest go first): a bound whatever policies name."""

_Key = tuple[str, str, str]


class SecretCredentials:
    """`credentials.CredentialSource` over the Kubernetes API."""

    def __init__(self, client: KubeClient, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self._cache: dict[_Key, tuple[float, str | credentials.CredentialUnavailable]] = {}

    async def repository_headers(
        self, namespace: str, credential: specs.RepositoryCredential | None
    ) -> dict[str, str]:
        if credential is None:
            return {}
        key = (namespace, credential.secret_name, credential.key)
        cached = self._cache.get(key)
        if cached is None or self._clock() - cached[0] >= CACHE_SECONDS:
            # A Secret that cannot give the value is remembered too: a policy naming a missing
            # one costs a GET a cache period, not one a pass.
            found: str | credentials.CredentialUnavailable
            try:
                found = await self._read(namespace, credential)
            except credentials.CredentialUnavailable as error:
                found = error
            self._cache.pop(key, None)
            self._cache[key] = cached = (self._clock(), found)
            while len(self._cache) > CACHED_AT_MOST:
                self._cache.pop(next(iter(self._cache)))
        value = cached[1]
        if isinstance(value, credentials.CredentialUnavailable):
            raise credentials.CredentialUnavailable(str(value))
        return {credential.header: value}

    def forget(self, namespace: str, credential: specs.RepositoryCredential | None) -> None:
        if credential is not None:
            self._cache.pop((namespace, credential.secret_name, credential.key), None)

    async def _read(self, namespace: str, credential: specs.RepositoryCredential) -> str:
        """The value, checked as a header value; raises CredentialUnavailable."""
        where = f"Secret {namespace}/{credential.secret_name}"
        try:
            secret = await self._client.request(
                f"reading {where}",
                "GET",
                namespaced("v1", namespace, "secrets", credential.secret_name),
            )
        except KubeError as error:
            raise credentials.CredentialUnavailable(_refusal(where, error)) from None
        data = (secret.get("data") or {}).get(credential.key)
        if data is None:
            raise credentials.CredentialUnavailable(f"{where} has no key {credential.key!r}")
        try:
            value = base64.b64decode(data, validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            value = ""
        checked = credentials.headers(
            credential.header, value, source=f"{where} key {credential.key!r}"
        )
        return checked[credential.header]


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
