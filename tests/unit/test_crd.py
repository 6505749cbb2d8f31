"""The CRD generated from the models: named, described, structural, and as strict as the parser."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from crd_checks import admission_errors, cel_errors, spec_schema

from batchpilot.api import crds, documents, names
from builders import BASE_SPEC, market_hours

REPO = Path(__file__).resolve().parents[2]


def test_crd_names_and_columns() -> None:
    crd = yaml.safe_load((REPO / "crds" / "batchpolicy.yaml").read_text(encoding="utf-8"))
    assert crd["metadata"]["name"] == "batchpolicies.batchpilot.dev"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "BatchPolicy",
        "batchpolicies",
        ["bp"],
    )
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = [column["name"] for column in version["additionalPrinterColumns"]]
    assert columns == ["Profile", "Desired", "Reason", "Targets", "Age"]


def _nodes(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _nodes(schema[key], f"{path}[]")


def test_every_field_is_described_and_structural() -> None:
    version = crds.render()["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for section in ("spec", "status"):
        for path, node in _nodes(root["properties"][section], section):
            if not path.endswith("[]"):
                assert node.get("description"), f"{path} has no description"
            assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
            assert not {"$ref", "anyOf", "allOf", "oneOf"} & node.keys(), (
                f"{path} is not structural"
            )


def test_every_default_is_valid_against_its_own_schema() -> None:
    """The API server refuses a CRD whose default does not validate (an unset optional field
    rendered as null inside an object's default, for one)."""
    import jsonschema

    version = crds.render()["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for section in ("spec", "status"):
        for path, node in _nodes(root["properties"][section], section):
            if "default" in node:
                found = list(jsonschema.Draft4Validator(node).iter_errors(node["default"]))
                assert not found, f"{path}'s default: {found[0].message}"


def test_sample_policy_is_admitted_and_parses() -> None:
    document = yaml.safe_load((REPO / "manifests" / "batchpolicy.yaml").read_text(encoding="utf-8"))
    spec = copy.deepcopy(document["spec"])
    spec["schedule"]["exceptions"] = [str(day) for day in spec["schedule"]["exceptions"]]
    assert admission_errors(spec) == []
    parsed = documents.parse_document(document)
    assert parsed.schedule is not None
    assert parsed.schedule.calendar == "XNYS"


INVALID = REPO / "tests" / "policies" / "invalid"


def invalid_policies() -> list[Any]:
    """The catalog of invalid policies; each file says which field path must be named."""
    cases = []
    for path in sorted(INVALID.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        expected = re.search(r"^# expect: (\S+)$", text, re.MULTILINE)
        assert expected, f"{path.name} lacks an '# expect: <field path>' line"
        cases.append(pytest.param(text, expected.group(1), id=path.stem))
    return cases


def test_catalog_has_at_least_ten_invalid_policies() -> None:
    assert len(invalid_policies()) >= 10


@pytest.mark.parametrize(("text", "field_path"), invalid_policies())
def test_invalid_policy_is_rejected_at_admission_and_by_the_parser(
    text: str, field_path: str
) -> None:
    document = yaml.safe_load(text)
    spec = json.loads(json.dumps(document["spec"], default=str))  # as JSON reaches the server
    admission = admission_errors(spec)
    assert any(error.startswith(field_path) for error in admission), admission

    with pytest.raises(documents.PolicyError) as raised:
        documents.parse_document(document)
    paths = [problem.path for problem in raised.value.problems]
    assert any(path.startswith(field_path) for path in paths), paths


def test_cel_rules_agree_with_python_on_a_valid_policy() -> None:
    spec = copy.deepcopy(BASE_SPEC)
    spec["schedule"] = market_hours()
    spec["load"] = {
        "rules": [{"profile": "bulk", "metric": "queueDepth", "above": 200, "below": 100}]
    }
    spec["slo"] = {"p95LatencyMs": 50, "profiles": ["interactive"]}
    spec["override"] = {"profile": "bulk"}
    assert cel_errors(spec) == []
    documents.parse_spec(spec)


def test_every_cel_rule_compiles() -> None:
    environment = celpy.Environment()
    rules = [
        rule["rule"]
        for _, node in _nodes(spec_schema(), "spec")
        for rule in node.get("x-kubernetes-validations", [])
    ]
    for rule in rules:
        environment.compile(rule)
    assert len(rules) >= 10


def test_llm_objectives_alone_are_an_slo_and_the_cel_rules_agree() -> None:
    spec = copy.deepcopy(BASE_SPEC)
    spec["slo"] = {"ttftP95Ms": 500, "itlP95Ms": 40, "guard": True}
    assert admission_errors(spec) == []
    parsed = documents.parse_spec(spec)
    assert parsed.slo is not None
    assert (parsed.slo.ttft_p95_ms, parsed.slo.itl_p95_ms, parsed.slo.p95_latency_ms) == (
        500,
        40,
        None,
    )


def test_the_crd_carries_the_revision_of_its_own_spec() -> None:
    """The chart refuses to run over an installed CRD whose revision differs (helm never
    upgrades crds/): any change of the spec, a field's description included, changes it."""
    crd = crds.render()
    annotated = crd["metadata"]["annotations"][names.CRD_REVISION_ANNOTATION]
    assert annotated == crds.revision(crd["spec"])
    assert len(annotated) == 16
    changed = copy.deepcopy(crd["spec"])
    changed["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "another release"
    assert crds.revision(changed) != annotated
