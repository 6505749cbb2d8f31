"""Just enough of the Kubernetes REST API for the cluster tooling: JSON requests.

The tooling talks to an API server it has just started, with certificate files it has just
written, so a few typed calls over urllib serve better than a generated client: nothing to import
slowly, nothing untyped, and one way to the API while the cluster starts.
"""

import contextlib
import dataclasses
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, cast

JsonObject = dict[str, Any]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclasses.dataclass(frozen=True, kw_only=True)
class Client:
    server: str
    ca_file: str
    cert_file: str
    key_file: str

    def _context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def _open(
        self,
        method: str,
        path: str,
        *,
        body: JsonObject | None = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        url = self.server + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            return urllib.request.urlopen(request, context=self._context(), timeout=timeout)
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                detail = json.loads(detail).get("message", detail)
            raise ApiError(error.code, detail) from None

    def request(
        self,
        method: str,
        path: str,
        *,
        body: JsonObject | None = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> JsonObject:
        with self._open(
            method, path, body=body, query=query, content_type=content_type, timeout=timeout
        ) as response:
            payload = response.read()
        return cast(JsonObject, json.loads(payload)) if payload else {}

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> JsonObject:
        return self.request("GET", path, query=query)

    def text(self, path: str, *, timeout: float = 5.0) -> str:
        with self._open("GET", path, timeout=timeout) as response:
            return cast(bytes, response.read()).decode()
