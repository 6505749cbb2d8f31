"""The credential of Triton servers whose model-repository API is locked to a header.

Triton started with `--http-restricted-api=model-repository:<header>=<value>` (and the gRPC
twin) refuses model loads, unloads and its repository index without that header, while
inference stays open: only the operator, which holds the value, can reload a model. Where the
value comes from is the driver's business: the operator reads the Secret a policy names
(`batchpilot.kube.secrets`), the standalone runner an environment variable or a file. Both
check it here, so a value Triton could never match fails before any server is asked.
"""

from __future__ import annotations

import re
from typing import Protocol

from batchpilot.api.v1alpha1 import specs

# Visible ASCII: a header value Triton's flag can carry (use e.g. `openssl rand -hex 32`).
_USABLE_VALUE = re.compile(r"^[\x21-\x7e]{1,4096}$")


class CredentialUnavailable(Exception):
    """The credential a policy names cannot be had; nothing is sent to any server."""


class CredentialSource(Protocol):
    async def repository_headers(
        self, namespace: str, credential: specs.RepositoryCredential | None
    ) -> dict[str, str]:
        """The headers for the policy's repository calls; raises CredentialUnavailable."""
        ...

    def forget(self, namespace: str, credential: specs.RepositoryCredential | None) -> None:
        """Triton refused the value given: read it afresh next time (a rotated Secret)."""
        ...


def headers(header: str, value: str, *, source: str) -> dict[str, str]:
    """The header to send, once its value is known to be one Triton's flag could hold."""
    value = value.strip()
    if not _USABLE_VALUE.match(value):
        raise CredentialUnavailable(
            f"{source} is not a usable header value (it must be 1 to 4096 visible ASCII "
            "characters, e.g. `openssl rand -hex 32`)"
        )
    return {header: value}


class NoCredentials:
    """No credential anywhere: policies that name one are told so, the others send none."""

    def __init__(self, *, hint: str = "this driver reads no Secrets") -> None:
        self._hint = hint

    async def repository_headers(
        self, namespace: str, credential: specs.RepositoryCredential | None
    ) -> dict[str, str]:
        if credential is not None:
            raise CredentialUnavailable(
                f"the policy names Secret {credential.secret_name!r}, but {self._hint}"
            )
        return {}

    def forget(self, namespace: str, credential: specs.RepositoryCredential | None) -> None:
        pass  # nothing read, nothing kept


class GivenCredential:
    """One value for every policy (the standalone runner's): sent under the policy's header,
    or the default header when the policy names no credential."""

    def __init__(self, value: str, *, source: str) -> None:
        self._value = value
        self._source = source

    async def repository_headers(
        self, namespace: str, credential: specs.RepositoryCredential | None
    ) -> dict[str, str]:
        header = credential.header if credential else specs.DEFAULT_REPOSITORY_HEADER
        return headers(header, self._value, source=self._source)

    def forget(self, namespace: str, credential: specs.RepositoryCredential | None) -> None:
        pass  # one value, given once
