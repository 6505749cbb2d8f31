"""Offline admission: the CRD's OpenAPI schema (jsonschema) and its CEL rules (cel-python).

This is what the API server does with a BatchPolicy, minus pruning and defaulting, so schema
and CEL mistakes show up in unit tests; the e2e suite repeats the cases against a real server.
"""

from __future__ import annotations

from typing import Any

import celpy
import jsonschema

from batchpilot.api import crds

_CEL = celpy.Environment()


def spec_schema() -> dict[str, Any]:
    version = crds.render()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def _path(parts: Any) -> str:
    return "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def schema_errors(spec: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(
        spec_schema(), format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER
    )
    errors = []
    for error in validator.iter_errors(spec):
        parts = list(error.absolute_path)
        if error.validator == "required":
            # The API server names the missing field itself: "spec.target: Required value".
            parts.append(error.message.split("'")[1])
        errors.append(f"{_path(parts)}: {error.message}")
    return errors


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The document after the API server's defaulting from the schema."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        defaulted = {
            name: field["default"]
            for name, field in properties.items()
            if "default" in field and name not in value
        }
        defaulted.update(value)
        return {
            name: with_defaults(
                properties.get(name) or schema.get("additionalProperties") or {}, child
            )
            for name, child in defaulted.items()
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [with_defaults(schema["items"], child) for child in value]
    return value


def cel_errors(spec: dict[str, Any]) -> list[str]:
    """Evaluate every x-kubernetes-validations rule where the document has a value."""
    found: list[str] = []

    def walk(schema: dict[str, Any], value: Any, path: str) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            program = _CEL.program(_CEL.compile(rule["rule"]))
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                found.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
        if isinstance(value, dict):
            for name, child in value.items():
                if name in schema.get("properties", {}):
                    walk(schema["properties"][name], child, f"{path}.{name}")
                elif isinstance(schema.get("additionalProperties"), dict):
                    walk(schema["additionalProperties"], child, f"{path}.{name}")
        elif isinstance(value, list) and "items" in schema:
            for index, child in enumerate(value):
                walk(schema["items"], child, f"{path}[{index}]")

    walk(spec_schema(), with_defaults(spec_schema(), spec), "spec")
    return found


def admission_errors(spec: dict[str, Any]) -> list[str]:
    """Schema errors first; CEL runs only on a schema-valid document, as in the API server."""
    return schema_errors(spec) or cel_errors(spec)
