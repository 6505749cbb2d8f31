"""A Triton model repository on a file system: the engine arguments an LLM model is served with.

Triton's vLLM backend takes its engine arguments from `model.json` in the model's version
directory, and the served configuration does not show them. Whoever applies an LLM profile lays
the profile's arguments over that file, so it needs the file as the repository has it: the
standalone runner reads the repository it is given, the sidecar reads the Pod's (a read-only
mount) and serves it to the operator, which cannot reach the Pod's files. Both read it here, and
the sidecar's answer carries `RepositoryArguments` as JSON.

A model name becomes a path, so it is checked first: a directory name as Triton names models,
never `.`, `..` or anything with a separator, and the file read must lie inside the repository.

A `model.json` may carry credentials (`hf_token`, an API key). The sidecar never serves them:
anything that reaches its port could read them. It names what it withheld, and the operator then
refuses the profile: the `model.json` it would write back through Triton's load request would lack
them. Engines should take credentials from their environment (e.g. `HF_TOKEN`) instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_ARGUMENTS_FILE = "model.json"
MAX_NUM_SEQS = 4096
MAX_NUM_BATCHED_TOKENS = 1_048_576
"""The most `max_num_seqs` and `max_num_batched_tokens` batchpilot sets: the CRD's bounds
(`specs.LlmEngine`) and the sidecar's recommendation's."""
MODEL_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
"""A model name as a directory of the repository: no separators, not `.` or `..`, nothing a
query or a path would have to escape. The CRD holds `spec.target.models` to it."""
MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
CREDENTIAL_NAME = re.compile(
    r"(^|_)(\w*token|\w*secret|passw\w*|pwd|passphrase|credentials?|api_?key|\w*auth\w*|key|"
    r"keyfile|bearer|cookie|signature|sig|sas|dsn|private)(_|$)"
)
"""An engine argument whose name, in snake case, has a word that says it is a credential
(`hf_token`, `aws_access_key_id`, `apiKey`, `db_password`): its values are never served.
Words, not letters: `tokenizer` is a model's path, not a credential."""
_URL_CREDENTIALS = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@")
"""A URL with user information (`https://user:password@host`)."""


class RepositoryError(Exception):
    """The engine arguments could not be read; the message says why."""


class InvalidModelName(RepositoryError):
    """The name is not one Triton could serve from a repository directory."""


class NotInRepository(RepositoryError):
    """The repository has no such model, or no `model.json` in its version directories."""


@dataclass(frozen=True)
class RepositoryArguments:
    """A model's engine arguments as its repository has them."""

    version: str
    """The version directory that holds `model.json`."""
    arguments: dict[str, Any]
    withheld: tuple[str, ...] = ()
    """The credentials left out of `arguments`, by their paths (`hf_token`, `a.api_key`)."""

    def to_json(self) -> dict[str, Any]:
        document = {"version": self.version, "arguments": self.arguments}
        return {**document, "withheld": list(self.withheld)} if self.withheld else document

    @classmethod
    def from_json(cls, document: object) -> RepositoryArguments:
        """Parse `to_json`'s document; raises ValueError saying what is wrong."""
        if not isinstance(document, Mapping):
            raise ValueError("not a JSON object")
        version, arguments = document.get("version"), document.get("arguments")
        if not isinstance(version, str) or not is_version(version):
            raise ValueError(f"version {version!r} is not a version directory's name")
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments {arguments!r} are not a JSON object")
        withheld = document.get("withheld") or []
        if withheld:
            names = ", ".join(str(name) for name in withheld)[:200]
            raise ValueError(
                f"its model.json carries credentials ({names}), which the sidecar does not serve "
                "and batchpilot would have to write back through Triton's load request; give "
                "the engine its credentials from the environment (e.g. HF_TOKEN) instead"
            )
        return cls(version=version, arguments=arguments)


def is_version(name: str) -> bool:
    """Whether a directory name is a model version as Triton reads one: ASCII digits only
    (`str.isdigit` also takes '²' and '٣', which `int` refuses or reads as another number)."""
    return name.isascii() and name.isdigit()


def is_credential_name(name: str) -> bool:
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower().replace("-", "_")
    return CREDENTIAL_NAME.search(snake) is not None


def _carries_credentials(value: Any) -> bool:
    """Whether a value under a credential's name holds anything: a flag or null does not."""
    if isinstance(value, dict | list):
        return any(
            _carries_credentials(item)
            for item in (value.values() if isinstance(value, dict) else value)
        )
    return value is not None and not isinstance(value, bool) and value != ""


def _url_credentials(value: str) -> bool:
    """A URL with a user and password, or a query parameter with a credential's name."""
    if not isinstance(value, str) or "://" not in value:
        return False
    if _URL_CREDENTIALS.match(value):
        return True
    # By hand: urllib is network code as far as the layers go, and this needs only the names.
    query = value.partition("#")[0].partition("?")[2]
    return any(is_credential_name(pair.partition("=")[0]) for pair in query.split("&") if pair)


def without_credentials(found: RepositoryArguments) -> RepositoryArguments:
    """The arguments fit to serve: everything under a credential's name (at any depth, in lists
    too) and every URL that carries a password or a credential's query parameter taken out."""
    withheld: list[str] = []

    def kept(value: Any, path: str) -> Any:
        if isinstance(value, list):
            inner_list = []
            for index, item in enumerate(value):
                where = f"{path}[{index}]"
                if _url_credentials(item):
                    withheld.append(where)
                else:
                    inner_list.append(kept(item, where))
            return inner_list
        if not isinstance(value, dict):
            return value
        inner: dict[str, Any] = {}
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if (is_credential_name(str(key)) and _carries_credentials(item)) or _url_credentials(
                item
            ):
                withheld.append(where)
            else:
                inner[key] = kept(item, where)
        return inner

    return RepositoryArguments(found.version, kept(found.arguments, ""), tuple(withheld))


def check_model_name(model: str) -> str:
    if not MODEL_NAME.fullmatch(model) or model in (".", ".."):
        raise InvalidModelName(
            f"{model!r} is not a model name (letters, digits, '_', '.', '-'; a directory of the "
            "model repository)"
        )
    return model


def read_repository_arguments(repository: Path, model: str) -> RepositoryArguments:
    """The `model.json` of the model's newest numbered version in `repository`."""
    directory = repository / check_model_name(model)
    if not directory.is_dir():
        raise NotInRepository(f"model {model!r} is not in the model repository {repository}")
    versions = sorted(
        (entry.name for entry in _directories(directory) if is_version(entry.name)),
        key=int,
        reverse=True,
    )
    for version in versions:
        path = directory / version / ENGINE_ARGUMENTS_FILE
        if path.is_file():
            return RepositoryArguments(version=version, arguments=_read(repository, path))
    raise NotInRepository(
        f"model {model!r} has no {ENGINE_ARGUMENTS_FILE} in a version directory of {directory}"
    )


def _read(repository: Path, path: Path) -> dict[str, Any]:
    # A link out of the repository would let a model name read any file the process can.
    if not path.resolve().is_relative_to(repository.resolve()):
        raise RepositoryError(f"{path} leads out of the model repository {repository}")
    try:
        arguments = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise RepositoryError(f"cannot read {path}: {error}") from None
    if not isinstance(arguments, dict):
        raise RepositoryError(f"{path} is not a JSON object")
    return arguments


def _directories(directory: Path) -> list[Path]:
    try:
        return [entry for entry in directory.iterdir() if entry.is_dir()]
    except OSError as error:
        raise RepositoryError(f"cannot list {directory}: {error}") from None
