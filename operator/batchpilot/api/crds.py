"""The BatchPolicy CustomResourceDefinition, rendered from the typed API models.

`crds/batchpolicy.yaml` (and the chart's copy) is the output of `render_yaml()`, which `make
generate` writes and a test checks current. Pydantic's JSON Schema is reshaped into a Kubernetes
structural schema: references inlined, nullable unions collapsed, int-or-string unions marked, and
each model's cross-field rules attached as CEL.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import yaml

from batchpilot.api import names, v1alpha1
from batchpilot.api.v1alpha1 import specs, statuses

CRD_NAME = names.CRD_NAME
_DROPPED_KEYS = {"title", "additionalProperties", "propertyNames"}


def _description(text: str) -> str:
    """Docstring text as one paragraph per blank-line-separated block."""
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _without_nulls(default: dict[str, Any]) -> dict[str, Any]:
    """An object's default without its unset optional fields: a structural schema's default
    must validate against it, and null is no object."""
    return {
        key: _without_nulls(value) if isinstance(value, dict) else value
        for key, value in default.items()
        if value is not None
    }


def _structural(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "anyOf" in node:
        variants = [variant for variant in node.pop("anyOf") if variant != {"type": "null"}]
        if len(variants) == 1:
            node = {**variants[0], **node}
        else:
            assert node.get("x-kubernetes-int-or-string"), f"unsupported union: {variants}"
    if "$ref" in node:
        target = definitions[node.pop("$ref").rsplit("/", 1)[-1]]
        # The field's own description is more specific than its type's.
        node = {**target, **node}
    if isinstance(node.get("default"), dict):
        node["default"] = _without_nulls(node["default"])
    if node.get("default", ...) in (None, [], {}):
        del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if isinstance(node.get("exclusiveMinimum"), int | float):
        node["minimum"] = node["exclusiveMinimum"]
        node["exclusiveMinimum"] = True
    shaped: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key == "description":
            shaped[key] = _description(value)
        elif key in ("properties",):
            shaped[key] = {name: _structural(field, definitions) for name, field in value.items()}
        elif key in ("items", "additionalProperties"):
            shaped[key] = _structural(value, definitions)
        else:
            shaped[key] = value
    return shaped


def openapi_schema(model: type[specs.Model]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of an API model."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    definitions = schema.pop("$defs", {})
    structural: dict[str, Any] = _structural(schema, definitions)
    return structural


def revision(crd_spec: dict[str, Any]) -> str:
    """A digest of the CRD's spec: equal for equal CRDs, whatever the release."""
    return hashlib.sha256(json.dumps(crd_spec, sort_keys=True).encode()).hexdigest()[:16]


def render() -> dict[str, Any]:
    """The CustomResourceDefinition as a Kubernetes object, with its revision annotated."""
    crd = _render()
    crd["metadata"]["annotations"] = {names.CRD_REVISION_ANNOTATION: revision(crd["spec"])}
    return crd


def _render() -> dict[str, Any]:
    spec_schema = openapi_schema(specs.BatchPolicySpec)
    status_schema = openapi_schema(statuses.BatchPolicyStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {
                "app.kubernetes.io/name": "batchpilot",
                "app.kubernetes.io/part-of": "batchpilot",
            },
        },
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": list(names.SHORT_NAMES),
                "categories": ["batchpilot"],
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": "Profile",
                            "type": "string",
                            "jsonPath": ".status.activeProfile",
                            "description": "The profile in force.",
                        },
                        {
                            "name": "Desired",
                            "type": "string",
                            "jsonPath": ".status.desiredProfile",
                            "description": (
                                "The profile decided: another than Profile while minDwellSeconds "
                                "holds it back or a rollout to it runs."
                            ),
                        },
                        {
                            "name": "Reason",
                            "type": "string",
                            "jsonPath": ".status.reason",
                            "description": "Why the profile applies.",
                        },
                        {
                            "name": "Targets",
                            "type": "string",
                            "jsonPath": ".status.targets.summary",
                            "description": "Servers running the profile.",
                        },
                        {
                            "name": "Age",
                            "type": "date",
                            "jsonPath": ".metadata.creationTimestamp",
                        },
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "A BatchPolicy makes a fleet of Triton Inference Servers switch "
                                "the dynamic-batching configuration of their models by market "
                                "hours, load and latency objective."
                            ),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated by `make generate` from batchpilot.api; do not edit.\n"


def render_yaml() -> str:
    return HEADER + yaml.safe_dump(render(), sort_keys=False, width=100, allow_unicode=True)
