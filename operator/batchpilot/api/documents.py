"""Policies as users write them: a BatchPolicy resource, or just its spec, in YAML or JSON.

Every problem is reported with the path of the field it is about, in the wire (camelCase)
names users wrote, e.g. `spec.profiles.interactive.maxQueueDelayMicroseconds`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic
import yaml

from batchpilot.api import names, v1alpha1
from batchpilot.api.v1alpha1 import specs

KIND = names.KIND
API_VERSION = v1alpha1.API_VERSION
"""The version policies are read in; a second version would be read here and converted."""


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class PolicyError(ValueError):
    """A policy that cannot be used, with every problem found."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(str(problem) for problem in self.problems))


def _path(location: Sequence[int | str], field_path: str = "") -> str:
    text = "spec"
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text + field_path


def _problems(error: pydantic.ValidationError) -> list[Problem]:
    problems = []
    for detail in error.errors(include_url=False):
        field_path = str((detail.get("ctx") or {}).get("field_path", ""))
        message = detail["msg"]
        if detail["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        problems.append(Problem(_path(detail["loc"], field_path), message))
    return problems


def parse_spec(spec: Any) -> specs.BatchPolicySpec:
    """A typed spec from its decoded form; raises PolicyError naming each bad field."""
    if not isinstance(spec, dict):
        raise PolicyError([Problem("spec", "must be a mapping")])
    try:
        return specs.parse_spec(spec)
    except pydantic.ValidationError as error:
        raise PolicyError(_problems(error)) from None


def parse_document(document: Any) -> specs.BatchPolicySpec:
    """A typed spec from a BatchPolicy resource, or from a bare spec."""
    if not isinstance(document, dict):
        raise PolicyError([Problem("(document)", "must be a BatchPolicy mapping")])
    if "kind" not in document and "apiVersion" not in document:
        return parse_spec(document)
    if document.get("kind") != KIND:
        raise PolicyError([Problem("kind", f"must be {KIND}, not {document.get('kind')!r}")])
    if document.get("apiVersion") != API_VERSION:
        raise PolicyError(
            [Problem("apiVersion", f"must be {API_VERSION}, not {document.get('apiVersion')!r}")]
        )
    if "spec" not in document:
        raise PolicyError([Problem("spec", "is required")])
    return parse_spec(document["spec"])


@dataclass(frozen=True)
class NamedPolicy:
    name: str
    spec: specs.BatchPolicySpec
    namespace: str = ""
    """metadata.namespace, if the document says; the runner labels its series with it."""
    status: Mapping[str, Any] = field(default_factory=dict)
    """The status, for a document read back from the cluster (`kubectl get bp NAME -o yaml`)."""


def parse_yaml_policy(text: str, *, default_name: str) -> NamedPolicy:
    """A policy from YAML (or JSON) text holding exactly one; its name is metadata.name, its
    namespace metadata.namespace."""
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise PolicyError([Problem("(yaml)", str(error))]) from None
    if len(documents) != 1:
        raise PolicyError([Problem("(document)", f"expected one policy, found {len(documents)}")])
    document = documents[0]
    spec = parse_document(document)
    metadata = document.get("metadata") if isinstance(document, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    status = document.get("status") if isinstance(document, dict) else None
    return NamedPolicy(
        name=str(name or default_name),
        spec=spec,
        namespace=str(namespace or ""),
        status=status if isinstance(status, dict) else {},
    )


def parse_yaml(text: str) -> specs.BatchPolicySpec:
    """A typed spec from YAML (or JSON) text holding exactly one policy."""
    return parse_yaml_policy(text, default_name="policy").spec
