"""Talking to one Triton server: its model-repository API, model configs and metrics.

Triton's HTTP/REST protocol (KServe v2 and its model-repository extension) spoken directly
with aiohttp, one session per server: every call bounded by a timeout and every answer by a size
cap (`batchpilot_triton.responses`), no redirect followed, Triton's and aiohttp's many failure
shapes turned into a few errors the actuator can act on, quoting at most a short excerpt of
Triton's own `error` (never another body, never the repository credential).

The repository credential goes to Triton's HTTP API and nowhere else: before the first call
that carries it, the server must say it is one (`GET /v2`, Triton's server metadata, lists the
`model_repository` extension). A port that a policy names for Triton but that is another
server's (the sidecar's, a proxy's) gets no credential, whatever it would do with it.

Not `tritonclient.http.aio`: the operator needs eight small JSON calls of it, and importing it
brings numpy, gevent and their kin, about a fifth of the operator's memory (22 MiB measured);
it also reads answers whole and cannot send a load's files, so it was wrapped at both ends.
The load generators and tests still speak inference through tritonclient.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import types
from collections.abc import Callable, Mapping
from typing import Any, Self
from urllib.parse import quote, urlsplit

import aiohttp

from batchpilot_triton import endpoints, responses, scraping
from batchpilot_triton.modelconfigs import ModelConfig

# Large metrics pages are parsed here, a few at a time for the whole process (threads start
# with the first such page).
_LARGE_PAGES = concurrent.futures.ThreadPoolExecutor(
    max_workers=responses.LARGE_PAGE_PARSES, thread_name_prefix="batchpilot-metrics"
)

# What Triton answers to a load or unload when it is not in explicit model-control mode.
_NOT_EXPLICIT = "explicit model load / unload is not allowed"
# What Triton answers to a restricted API's call that lacks the header, or has a wrong value.
_RESTRICTED = "This API is restricted"


class TritonError(Exception):
    """Something went wrong talking to a Triton server."""

    def __init__(self, url: str, message: str) -> None:
        self.url = url
        self.message = message
        super().__init__(f"{url}: {message}")


class Unreachable(TritonError):
    """The server did not answer in time, or refused the connection."""


class ExplicitModeRequired(TritonError):
    """The server refuses model loads: it must run with --model-control-mode=explicit."""


class ModelUnavailable(TritonError):
    """The model is not loaded on the server (or does not exist in its repository)."""


class LoadRejected(TritonError):
    """The server could not load the model with the given configuration."""


class RepositoryLocked(TritonError):
    """The server restricts its model-repository API, and refused the credential header sent
    (or its absence): nothing was loaded or unloaded."""


class NotTriton(RepositoryLocked):
    """The credential was not sent: the server does not answer as Triton's HTTP API."""


class _Refused(Exception):
    """An error answer of Triton's: its status and its own words (`error`), an excerpt."""

    def __init__(self, status: int, said: str) -> None:
        self.status = status
        self.said = said
        super().__init__(f"HTTP {status}: {said}")


def host_port(url: str) -> str:
    """`host:port` of an HTTP endpoint given with or without a scheme."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"Triton URL {url!r} needs a host and a port, e.g. http://10.0.0.5:8000")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


def default_metrics_url(url: str, port: int = endpoints.TRITON_METRICS_PORT) -> str:
    """Triton's metrics endpoint on the same host as its HTTP endpoint, on its default port."""
    host = host_port(url).rsplit(":", 1)[0]
    return f"http://{host}:{port}/metrics"


def _credential_summary(headers: Mapping[str, str]) -> str:
    """Which header was sent, never its value."""
    if not headers:
        return "none was sent"
    return "sent: " + ", ".join(sorted(headers))


class TritonServer:
    """One Triton server, addressed by its HTTP endpoint. Use as an async context manager."""

    def __init__(
        self,
        url: str,
        *,
        metrics_url: str | None = None,
        request_timeout: float = responses.TRITON_DEADLINE_SECONDS,
        load_timeout: float = 300.0,
        liveness_interval: float = 5.0,
        liveness_misses: int = 3,
        repository_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.address = host_port(url)
        self.url = f"http://{self.address}"
        self.metrics_url = metrics_url or default_metrics_url(url)
        self.request_timeout = request_timeout
        self.load_timeout = load_timeout
        self.liveness_interval = liveness_interval
        """How often a load or unload in progress checks that the server still answers."""
        self.liveness_misses = liveness_misses
        """Liveness checks missed in a row after which a load or unload is given up."""
        self.repository_headers: dict[str, str] = dict(repository_headers or {})
        """Sent on every model-repository call (index, load, unload): the credential of a
        Triton started with --http-restricted-api=model-repository:<header>=<value>."""
        self._session: aiohttp.ClientSession | None = None
        self._confirmed_triton = False
        """Whether this session's server said it is Triton's HTTP API (`_confirm_triton`)."""
        self._parsing: concurrent.futures.Future[scraping.Snapshot] | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        # Taken out first: a caller that asks for a session meanwhile gets a new one.
        session, self._session = self._session, None
        self._confirmed_triton = False
        if session is not None:
            await session.close()

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily: aiohttp sessions belong to the running event loop. The load timeout
        # is a backstop; each call's own deadline (`_call`) is what ends it. A server closed
        # while a caller still holds it opens a new session for that caller's next call.
        if self._session is None or self._session.closed:
            self._session = responses.client_session(
                connector=aiohttp.TCPConnector(limit=4),
                timeout=aiohttp.ClientTimeout(total=self.load_timeout),
            )
            self._confirmed_triton = False
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """One call of Triton's HTTP API: its JSON answer (None for an empty one), or _Refused
        for an error answer. The answer is read up to TRITON_JSON_BYTES."""
        async with self._client().request(
            method,
            f"{self.url}/{path}",
            data=None if body is None else json.dumps(body),
            headers=headers,
        ) as response:
            if response.status != 200:
                raise _Refused(response.status, await _error_message(response))
            answer = await responses.read_capped(response, responses.TRITON_JSON_BYTES)
            return json.loads(answer) if answer.strip() else None

    async def _repository_request(
        self, method: str, path: str, *, body: Mapping[str, Any] | None = None
    ) -> Any:
        """A model-repository call, with the credential once the server said it is Triton."""
        if self.repository_headers and not self._confirmed_triton:
            await self._confirm_triton()
        return await self._request(method, path, body=body, headers=self.repository_headers)

    async def _confirm_triton(self) -> None:
        async with self._client().get(f"{self.url}/v2") as response:
            answer = b""
            if response.status == 200:
                answer = await responses.read_capped(response, responses.ERROR_BYTES)
        try:
            document = json.loads(answer)
        except ValueError:
            document = None
        extensions = document.get("extensions") if isinstance(document, dict) else None
        if not isinstance(extensions, list) or "model_repository" not in extensions:
            raise NotTriton(
                self.url,
                "the server does not answer as Triton's HTTP API (GET /v2 lists no "
                "model_repository extension), so the repository credential was not sent to it: "
                "spec.target.port must name Triton's HTTP port",
            )
        self._confirmed_triton = True

    def _redacted(self, message: str) -> str:
        """The message without the credential's value, wherever a server put it."""
        for value in self.repository_headers.values():
            if value:
                message = message.replace(value, "<redacted>")
        return message

    async def _answers_ok(self, path: str) -> bool:
        """Whether a health or readiness endpoint answers 200 (its body says nothing more)."""
        async with self._client().get(f"{self.url}/{path}") as response:
            return response.status == 200

    @staticmethod
    def _model(model: str) -> str:
        return f"v2/models/{quote(model, safe='')}"

    async def _call(self, what: str, call: Any, *, seconds: float | None = None) -> Any:
        try:
            async with asyncio.timeout(seconds or self.request_timeout):
                return await call
        except TimeoutError:
            waited = seconds or self.request_timeout
            raise Unreachable(self.url, f"{what}: no answer within {waited:g}s") from None
        except TritonError as error:
            raise type(error)(self.url, self._redacted(f"{what}: {error.message}")) from None
        except aiohttp.ClientError as error:
            text = self._redacted(responses.client_error_text(error))
            raise Unreachable(self.url, f"{what}: {text}") from None
        except OSError as error:
            raise Unreachable(self.url, self._redacted(f"{what}: {error}")) from None
        except ValueError:
            raise TritonError(self.url, f"{what}: the answer is not JSON") from None
        except _Refused as error:
            raise self._refusal(what, error) from None

    def _refusal(self, what: str, error: _Refused) -> TritonError:
        said = error.said
        # Taken out before the excerpt is cut: a cut value would no longer match.
        message = responses.excerpt(self._redacted(said))
        if _RESTRICTED in said:
            return RepositoryLocked(
                self.url,
                f"{what}: the server restricts its model-repository API and refused the "
                f"credential ({_credential_summary(self.repository_headers)}): check the "
                "header and value it was started with (--http-restricted-api)",
            )
        if _NOT_EXPLICIT in said:
            return ExplicitModeRequired(
                self.url,
                f"{what}: the server refuses model loads ({message}); start tritonserver "
                "with --model-control-mode=explicit",
            )
        if error.status in (400, 404) or "unknown model" in said:
            return ModelUnavailable(self.url, f"{what}: {message}")
        return TritonError(self.url, f"{what}: {message}")

    async def is_ready(self) -> bool:
        return bool(await self._call("server readiness", self._answers_ok("v2/health/ready")))

    async def model_ready(self, model: str) -> bool:
        ready = self._answers_ok(f"{self._model(model)}/ready")
        return bool(await self._call(f"readiness of {model}", ready))

    async def model_config(self, model: str) -> ModelConfig:
        config = await self._call(
            f"config of {model}", self._request("GET", f"{self._model(model)}/config")
        )
        if not isinstance(config, dict):
            raise TritonError(self.url, f"config of {model}: the answer is not a JSON object")
        return config

    async def repository_index(self) -> list[dict[str, Any]]:
        """Every model in the repository, with its state (READY, LOADING, UNLOADING, ...)."""
        index = await self._call(
            "model index",
            self._repository_request("POST", "v2/repository/index"),
        )
        if not isinstance(index, list) or not all(isinstance(entry, dict) for entry in index):
            raise TritonError(self.url, "model index: the answer is not a list of models")
        return index

    async def loaded_models(self) -> list[str]:
        index = await self.repository_index()
        return sorted(entry["name"] for entry in index if entry.get("state") == "READY")

    async def model_states(self, model: str) -> set[str]:
        """The states of the model's versions in the repository index (none: never loaded)."""
        index = await self.repository_index()
        return {str(entry.get("state")) for entry in index if entry.get("name") == model}

    async def _while_live(self, what: str, call: Any) -> Any:
        """A model load or unload, bounded by the load timeout, and given up as Unreachable once
        the server misses `liveness_misses` liveness checks in a row: a large model may load
        for minutes, but a server cut off mid-load would otherwise hold the caller (and its
        rollout) for the whole load timeout."""
        task = asyncio.ensure_future(self._call(what, call, seconds=self.load_timeout))
        misses = 0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.liveness_interval)
                if done:
                    return task.result()
                try:
                    live = await self._call("liveness", self._answers_ok("v2/health/live"))
                except TritonError:
                    live = False
                misses = 0 if live else misses + 1
                if misses >= self.liveness_misses:
                    raise Unreachable(
                        self.url,
                        f"{what}: the server stopped answering while it ran "
                        f"({misses} liveness checks missed in a row)",
                    )
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, TritonError):
                    await task

    async def load(
        self,
        model: str,
        config: ModelConfig | None = None,
        *,
        files: Mapping[str, bytes] | None = None,
    ) -> None:
        """Load (or reload) a model, with Triton's config override and `file:<path>` overrides;
        with files, Triton loads the model from a directory holding only those files."""
        parameters: dict[str, str] = {
            path: base64.b64encode(content).decode() for path, content in (files or {}).items()
        }
        if config is not None:
            parameters["config"] = json.dumps(config)
        request = self._repository_request(
            "POST",
            f"v2/repository/models/{quote(model, safe='')}/load",
            body={"parameters": parameters} if parameters else {},
        )
        try:
            await self._while_live(f"load of {model}", request)
        except (Unreachable, ExplicitModeRequired, RepositoryLocked):
            raise
        except TritonError as error:
            raise LoadRejected(self.url, error.message) from None

    async def unload(self, model: str) -> None:
        await self._while_live(
            f"unload of {model}",
            self._repository_request(
                "POST",
                f"v2/repository/models/{quote(model, safe='')}/unload",
                body={"parameters": {"unload_dependents": False}},
            ),
        )

    async def statistics(self, model: str = "") -> list[dict[str, Any]]:
        """Triton's statistics extension for one model, or all (`GET v2/models[/NAME]/stats`):
        per model version, cumulative counts and times, also per exact batch size."""
        path = f"{self._model(model)}/stats" if model else "v2/models/stats"
        found = await self._call("statistics", self._request("GET", path))
        stats = found.get("model_stats", []) if isinstance(found, dict) else None
        if not isinstance(stats, list):
            raise TritonError(self.url, "statistics: the answer has no list of model_stats")
        return stats

    async def metrics_text(self) -> str:
        """Triton's Prometheus metrics page."""

        async def fetch() -> str:
            async with self._client().get(self.metrics_url) as response:
                response.raise_for_status()
                page = await responses.read_capped(response, responses.METRICS_PAGE_BYTES)
                return page.decode(response.get_encoding(), errors="replace")

        text: str = await self._call("metrics", fetch())
        return text

    async def metrics_snapshot(self, clock: Callable[[], float]) -> scraping.Snapshot:
        """Triton's metrics page, parsed, taken at `clock()` when it arrived (the operator's
        reading: the sidecar parses its own Triton's pages whole).

        Parsing costs about 1.3 KiB and 60 us a series on a busy core, so a page of more than
        `METRICS_PAGE_LINES` lines is refused unparsed. A page over 256 KiB is parsed off the
        event loop every policy shares, in a pool of `LARGE_PAGE_PARSES` threads for the whole
        process (so memory stays bounded however many servers send large pages), one page of
        a server at a time: a server whose pages outrun their parsing is refused until the
        last one is done. Waiting for the pool ends with the caller's deadline."""
        page = await self.metrics_text()
        taken_at = clock()
        if page.count("\n") > responses.METRICS_PAGE_LINES:
            raise TritonError(
                self.url,
                f"metrics: the page has more than {responses.METRICS_PAGE_LINES} lines; not parsed",
            )
        if len(page) <= responses.INLINE_PARSE_CHARS:
            return scraping.parse(page, taken_at=taken_at)
        if self._parsing is not None and not self._parsing.done():
            raise TritonError(self.url, "metrics: its previous page is still being parsed")
        self._parsing = _LARGE_PAGES.submit(scraping.parse, page, taken_at=taken_at)
        return await asyncio.wrap_future(self._parsing)


async def _error_message(response: aiohttp.ClientResponse) -> str:
    """Triton's `error` of an error answer, else its status and reason only: a body in any
    other shape is not Triton's words, and may be a request quoted back. Whole (up to
    ERROR_BYTES): the caller takes the credential out, then cuts an excerpt."""
    refused = f"HTTP {response.status} {response.reason or ''}".rstrip()
    try:
        answer = await responses.read_capped(response, responses.ERROR_BYTES)
        document = json.loads(answer)
    except (responses.TooLarge, ValueError):
        return refused
    found = document.get("error") if isinstance(document, dict) else None
    return found if isinstance(found, str) and found.strip() else refused
