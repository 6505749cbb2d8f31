"""A Pod's model repository, read through the sidecar beside Triton: an LLM model's engine
arguments.

In a cluster the operator cannot read a Pod's model repository, but the sidecar in the Pod can:
it mounts the repository read-only (`--model-repository`) and serves a model's `model.json` at
`/v1/models/<model>/engine-arguments`. Profile switches are rare, so each read opens its own
connection and nothing is kept open between them. The sidecar is a Pod of the policy's
namespace: its answer is read under a deadline and up to a cap, no redirect is followed, and an
error quotes at most an excerpt of the sidecar's own `error`, never another body
(`batchpilot_triton.responses`).
"""

from __future__ import annotations

import json
from urllib.parse import quote

import aiohttp

from batchpilot.applying import engines
from batchpilot.applying.replicas import Replica
from batchpilot_triton import repositories, responses


def engine_arguments_url(sidecar_url: str, model: str) -> str:
    return f"{sidecar_url.rstrip('/')}/v1/models/{quote(model, safe='')}/engine-arguments"


class SidecarEngineArguments:
    """An `EngineArgumentsSource` that asks the replica's sidecar."""

    def __init__(
        self,
        *,
        timeout: float = responses.ENGINE_ARGUMENTS_DEADLINE_SECONDS,
        limit: int = responses.ENGINE_ARGUMENTS_BYTES,
    ) -> None:
        self._timeout = timeout
        self._limit = limit

    async def repository_arguments(
        self, replica: Replica, model: str
    ) -> repositories.RepositoryArguments:
        if replica.sidecar_url is None:
            raise engines.EngineArgumentsUnavailable(
                f"model {model!r} is served by Triton's vLLM backend: its repository's "
                f"model.json is read from the sidecar beside {replica.title}, which has none "
                "(no container port named by spec.target.sidecarPort)"
            )
        try:
            # A name like `..` would not even reach the sidecar's endpoint as itself.
            url = engine_arguments_url(replica.sidecar_url, repositories.check_model_name(model))
        except repositories.InvalidModelName as error:
            raise engines.EngineArgumentsUnavailable(str(error)) from None
        try:
            async with (
                responses.client_session(
                    timeout=aiohttp.ClientTimeout(total=self._timeout)
                ) as session,
                session.get(url) as response,
            ):
                status = response.status
                limit = self._limit if status == 200 else responses.ERROR_BYTES
                body = await responses.read_capped(response, limit)
        except TimeoutError:
            raise engines.EngineArgumentsUnavailable(
                f"sidecar {replica.sidecar_url} of {replica.title}: "
                f"no answer within {self._timeout:g}s"
            ) from None
        except aiohttp.ClientError as error:
            raise engines.EngineArgumentsUnavailable(
                f"sidecar {replica.sidecar_url} of {replica.title}: "
                f"{responses.client_error_text(error)}"
            ) from None
        return _parsed(body, status, sidecar=replica.sidecar_url, model=model)


def _parsed(
    body: bytes, status: int, *, sidecar: str, model: str
) -> repositories.RepositoryArguments:
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if status != 200:
        reason = document.get("error") if isinstance(document, dict) else None
        said = responses.excerpt(reason) if isinstance(reason, str) and reason.strip() else ""
        raise engines.EngineArgumentsUnavailable(
            f"sidecar {sidecar}: no engine arguments for model {model!r} (HTTP {status})"
            + (f": {said}" if said else "")
        )
    try:
        return repositories.RepositoryArguments.from_json(document)
    except ValueError as error:
        raise engines.EngineArgumentsUnavailable(
            f"sidecar {sidecar}: engine arguments for model {model!r}: "
            f"{responses.excerpt(str(error))}"
        ) from None
