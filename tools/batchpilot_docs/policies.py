"""The BatchPolicy reference, from the API models.

It walks the CRD's structural schema (`batchpilot.api.crds.openapi_schema`, the very schema the
API server enforces) rather than the pydantic classes: field names as users write them, every
bound the API server checks, and each object's cross-field rules with their messages. Examples
are the values the sample policies in `manifests/` set, so the page shows real use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batchpilot.api import crds, names, v1alpha1
from batchpilot.api.v1alpha1 import specs, statuses
from batchpilot_docs import formats

SAMPLES = (Path("manifests") / "batchpolicy.yaml", Path("manifests") / "policies")
EVERY_FIELD = Path("docs") / "examples" / "every-field.yaml"
"""Examples of the fields the samples leave out; the samples' own values come first."""


@dataclass(frozen=True)
class ObjectSection:
    """One object of the API: its path from the resource's root and its schema."""

    path: str
    schema: Mapping[str, Any]


def objects(path: str, schema: Mapping[str, Any]) -> Iterator[ObjectSection]:
    """Every object with fields under `schema`, itself first, depth first."""
    if "properties" in schema:
        yield ObjectSection(path, schema)
        for field, child in schema["properties"].items():
            yield from objects(f"{path}.{field}", child)
    elif "items" in schema:
        yield from objects(f"{path}[]", schema["items"])
    elif isinstance(schema.get("additionalProperties"), dict):
        yield from objects(f"{path}.<name>", schema["additionalProperties"])


def anchor(path: str) -> str:
    """The heading id of an object's section (MkDocs' slugs drop the dots and brackets)."""
    return "".join(c if c.isalnum() else "-" for c in path.lower()).strip("-")


def _type(path: str, schema: Mapping[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if "properties" in schema:
        return f"[object](#{anchor(path)})"
    if "items" in schema:
        return f"list of {_type(f'{path}[]', schema['items'])}"
    if isinstance(schema.get("additionalProperties"), dict):
        return f"map of string to {_type(f'{path}.<name>', schema['additionalProperties'])}"
    kind = str(schema.get("type", "any"))
    return f"{kind} ({schema['format']})" if "format" in schema else kind


_SIZES = {"Length": "characters", "Items": "items", "Properties": "entries"}


def _bounds(schema: Mapping[str, Any]) -> list[str]:
    bounds = []
    if "enum" in schema:
        bounds.append("one of " + ", ".join(formats.code(value) for value in schema["enum"]))
    if "items" in schema and "enum" in schema["items"]:
        bounds.append("each one of " + ", ".join(formats.code(v) for v in schema["items"]["enum"]))
    low, high = schema.get("minimum"), schema.get("maximum")
    above = "more than" if schema.get("exclusiveMinimum") is True else "at least"
    if low is not None and high is not None and above == "at least":
        bounds.append(f"{formats.code(low)} to {formats.code(high)}")
    else:
        if low is not None:
            bounds.append(f"{above} {formats.code(low)}")
        if high is not None:
            bounds.append(f"at most {formats.code(high)}")
    for key, unit in _SIZES.items():
        fewest, most = schema.get(f"min{key}"), schema.get(f"max{key}")
        if fewest is not None and most is not None:
            bounds.append(f"{fewest} to {most} {unit}")
        elif fewest is not None:
            bounds.append(f"at least {fewest} {unit}")
        elif most is not None:
            bounds.append(f"at most {most} {unit}")
    if "pattern" in schema:
        bounds.append(f"matches {formats.code(schema['pattern'])}")
    for nested in ("items", "additionalProperties"):
        child = schema.get(nested)
        if isinstance(child, dict) and "properties" not in child:
            bounds += [f"each {bound}" for bound in _bounds(child) if "one of" not in bound]
    if schema.get("x-kubernetes-list-type") in ("set", "map"):
        bounds.append("no duplicates")
    return bounds


def sample_values(repository: Path) -> dict[str, list[Any]]:
    """The values the sample policies set, by field path (`spec.schedule.windows[].start`)."""
    found: dict[str, list[Any]] = {}

    def walk(path: str, value: Any, schema: Mapping[str, Any]) -> None:
        found.setdefault(path, []).append(value)
        if isinstance(value, dict) and "properties" in schema:
            for key, item in value.items():
                if key in schema["properties"]:
                    walk(f"{path}.{key}", item, schema["properties"][key])
        elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
            for item in value.values():
                walk(f"{path}.<name>", item, schema["additionalProperties"])
        elif isinstance(value, list) and "items" in schema:
            for item in value:
                walk(f"{path}[]", item, schema["items"])

    spec_schema = crds.openapi_schema(specs.BatchPolicySpec)
    files = [
        repository / SAMPLES[0],
        *sorted((repository / SAMPLES[1]).glob("*.yaml")),
        repository / EVERY_FIELD,
    ]
    for file in files:
        for document in yaml.safe_load_all(file.read_text(encoding="utf-8")):
            if isinstance(document, dict) and document.get("kind") == names.KIND:
                walk("spec", document["spec"], spec_schema)
    return found


def _example(path: str, schema: Mapping[str, Any], samples: Mapping[str, list[Any]]) -> str:
    if "properties" in schema:
        return ""
    for value in samples.get(path, []):
        text = formats.code(value)
        if len(text) <= 60:
            return text
    return ""


def _rules(section: ObjectSection) -> str:
    rules = section.schema.get("x-kubernetes-validations", [])
    if not rules:
        return ""
    lines = [
        "Rules the API server checks on admission (and `batchpilot run` and `explain` on reading):",
        "",
    ]
    for rule in rules:
        where = (
            f" (reported at {formats.code(section.path + rule['fieldPath'])})"
            if "fieldPath" in rule
            else ""
        )
        lines.append(f"- {rule['message']}{where}. CEL: {formats.code(rule['rule'])}")
    return "\n".join(lines) + "\n"


def _section(section: ObjectSection, samples: Mapping[str, list[Any]]) -> str:
    required = set(section.schema.get("required", []))
    rows = []
    for field, schema in section.schema["properties"].items():
        path = f"{section.path}.{field}"
        default = "required" if field in required else (
            formats.code(schema["default"]) if "default" in schema else ""
        )  # fmt: skip
        rows.append(
            (
                formats.code(field),
                _type(path, schema),
                default,
                "; ".join(_bounds(schema)),
                _example(path, schema, samples),
                schema.get("description", ""),
            )
        )
    parts = [f"### `{section.path}` {{#{anchor(section.path)}}}", ""]
    if section.schema.get("description"):
        parts += [section.schema["description"], ""]
    parts.append(
        formats.table(("Field", "Type", "Default", "Bounds", "Example", "What it does"), rows)
    )
    rules = _rules(section)
    if rules:
        parts += ["", rules]
    return "\n".join(parts).rstrip() + "\n"


def page(repository: Path) -> str:
    """docs/reference/batchpolicy.md."""
    samples = sample_values(repository)
    sample = (repository / SAMPLES[0]).read_text(encoding="utf-8")
    spec = list(objects("spec", crds.openapi_schema(specs.BatchPolicySpec)))
    status = list(objects("status", crds.openapi_schema(statuses.BatchPolicyStatus)))
    short_names = ", ".join(formats.code(name) for name in names.SHORT_NAMES)
    intro = f"""# BatchPolicy reference

`{names.KIND}` (`{names.GROUP}/{v1alpha1.VERSION}`, short names {short_names}) is a namespaced
resource. Every field below, with its type, default, bounds and cross-field rules, comes from the
API models in `operator/batchpilot/api` through the schema the CRD carries, so `kubectl explain
batchpolicy.spec` says the same. Fields are camelCase; a field marked required must be given,
any other may be left out. Examples are values the sample policies in `manifests/` set, and
`docs/examples/every-field.yaml` for the fields they leave out.

The sample policy, `manifests/batchpolicy.yaml`:

```yaml
{sample.rstrip()}
```

## Spec
"""
    body = "\n".join(_section(section, samples) for section in spec)
    status_intro = (
        "\n## Status\n\nWritten by the operator (and never by a policy author): "
        "`kubectl get bp -o yaml` shows it.\n\n"
    )
    status_body = "\n".join(_section(section, {}) for section in status)
    return (
        formats.header("the API models in operator/batchpilot/api")
        + intro
        + "\n"
        + body
        + status_intro
        + status_body
    )
