"""The chart's values: its defaults satisfy values.schema.json, which refuses unknown keys at
every level the chart owns (e2e/test_chart.py has helm itself refuse them too)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "batchpilot"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())


def problems(values: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [error.message for error in validator.iter_errors(values)]


def test_defaults_are_valid_and_restricted() -> None:
    assert problems(DEFAULTS) == []
    assert DEFAULTS["replicaCount"] == 2
    assert DEFAULTS["operator"]["peering"]["enabled"] is True
    assert DEFAULTS["securityContext"]["readOnlyRootFilesystem"] is True
    assert DEFAULTS["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert DEFAULTS["podSecurityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_every_default_key_is_described_by_the_schema() -> None:
    def walk(values: dict[str, Any], schema: dict[str, Any], path: str) -> None:
        properties = schema.get("properties")
        if properties is None:
            return  # a Kubernetes object passed through as it is (resources, affinity, ...)
        assert schema.get("additionalProperties") is False, path
        for key, value in values.items():
            assert key in properties, f"{path}.{key}"
            if isinstance(value, dict):
                walk(value, properties[key], f"{path}.{key}")

    walk(DEFAULTS, SCHEMA, "values")


@pytest.mark.parametrize(
    "path",
    [
        ("replicas",),
        ("image", "tags"),
        ("operator", "namespace"),
        ("serviceMonitor", "label"),
        ("grafana", "dashboard", "enable"),
        ("networkPolicy", "ingress"),
    ],
    ids=".".join,
)
def test_unknown_keys_are_refused(path: tuple[str, ...]) -> None:
    values = copy.deepcopy(DEFAULTS)
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = "x"
    assert any("Additional properties are not allowed" in problem for problem in problems(values))


def test_wrong_types_and_ranges_are_refused() -> None:
    for path, value in ((("metrics", "port"), 70000), (("operator", "interval"), 0)):
        values = copy.deepcopy(DEFAULTS)
        values[path[0]][path[1]] = value
        assert problems(values), path
