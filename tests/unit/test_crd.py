"""The CRD: generated from the models, in sync with crds/, and as strict as the Python parser."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from builders import BASE_SPEC, market_hours, window
from crd_checks import admission_errors, cel_errors, spec_schema

from batchpilot import crds
from batchpilot.policy import documents

REPO = Path(__file__).resolve().parents[2]
Mutation = Callable[[dict[str, Any]], None]


def test_crd_file_is_generated_from_the_models() -> None:
    on_disk = (REPO / "crds" / "batchpolicy.yaml").read_text(encoding="utf-8")
    assert on_disk == crds.render_yaml(), "run: python -m batchpilot.crds crds/batchpolicy.yaml"


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
    assert columns == ["Profile", "Reason", "Targets", "Age"]


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


def test_sample_policy_is_admitted_and_parses() -> None:
    document = yaml.safe_load((REPO / "manifests" / "batchpolicy.yaml").read_text(encoding="utf-8"))
    spec = copy.deepcopy(document["spec"])
    spec["schedule"]["exceptions"] = [str(day) for day in spec["schedule"]["exceptions"]]
    assert admission_errors(spec) == []
    parsed = documents.parse_document(document)
    assert parsed.schedule is not None
    assert parsed.schedule.calendar == "XNYS"


def _set(path: str, value: Any) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[leaf] = value

    return mutate


def _delete(key: str) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        del spec[key]

    return mutate


def _with_schedule(spec: dict[str, Any]) -> None:
    spec["schedule"] = market_hours()


def _then(*mutations: Mutation) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        for mutation in mutations:
            mutation(spec)

    return mutate


RULE = {"profile": "bulk", "metric": "queueDepth", "above": 200}

# (case, mutation of the base spec, the field path both the API server and the parser name)
INVALID_POLICIES: list[tuple[str, Mutation, str]] = [
    ("missing default profile", _delete("defaultProfile"), "spec.defaultProfile"),
    ("missing target", _delete("target"), "spec.target"),
    (
        "queue delay above a minute",
        _set("profiles.interactive.maxQueueDelayMicroseconds", 60_000_001),
        "spec.profiles.interactive.maxQueueDelayMicroseconds",
    ),
    (
        "negative queue delay",
        _set("profiles.bulk.maxQueueDelayMicroseconds", -1),
        "spec.profiles.bulk.maxQueueDelayMicroseconds",
    ),
    (
        "queue delay not a number",
        _set("profiles.bulk.maxQueueDelayMicroseconds", "fast"),
        "spec.profiles.bulk.maxQueueDelayMicroseconds",
    ),
    (
        "batch size zero",
        _set("profiles.interactive.preferredBatchSizes", [0]),
        "spec.profiles.interactive.preferredBatchSizes[0]",
    ),
    (
        "batch size above 4096",
        _set("profiles.bulk.maxBatchSize", 5000),
        "spec.profiles.bulk.maxBatchSize",
    ),
    (
        "unknown timeout action",
        _set("profiles.bulk.queuePolicy", {"timeoutAction": "DROP"}),
        "spec.profiles.bulk.queuePolicy.timeoutAction",
    ),
    (
        "weekday spelled out",
        _set("schedule", {"windows": [window("interactive", "09:30", "16:00", days=["Monday"])]}),
        "spec.schedule.windows[0].days[0]",
    ),
    (
        "start without leading zero",
        _set("schedule", {"windows": [window("interactive", "9:30", "16:00")]}),
        "spec.schedule.windows[0].start",
    ),
    (
        "end past midnight",
        _set("schedule", {"windows": [window("interactive", "09:30", "25:00")]}),
        "spec.schedule.windows[0].end",
    ),
    (
        "unknown load metric",
        _set("load", {"rules": [{**RULE, "metric": "cpu"}]}),
        "spec.load.rules[0].metric",
    ),
    (
        "duration in words",
        _set("load", {"rules": [{**RULE, "for": "1 minute"}]}),
        "spec.load.rules[0].for",
    ),
    (
        "override until not a time",
        _set("override", {"profile": "bulk", "until": "tonight"}),
        "spec.override.until",
    ),
    ("zero dwell is fine but negative is not", _set("minDwellSeconds", -5), "spec.minDwellSeconds"),
    # Cross-field rules: CEL in the API server, the same predicates in Python.
    (
        "default profile not among profiles",
        _set("defaultProfile", "overnight"),
        "spec.defaultProfile",
    ),
    (
        "window names an unknown profile",
        _set("schedule", {"windows": [window("overnight", "20:00", "06:00")]}),
        "spec.schedule.windows",
    ),
    (
        "load rule names an unknown profile",
        _set("load", {"rules": [{**RULE, "profile": "overnight"}]}),
        "spec.load.rules",
    ),
    (
        "override names an unknown profile",
        _set("override", {"profile": "overnight"}),
        "spec.override.profile",
    ),
    (
        "window starts where it ends",
        _set("schedule", {"windows": [window("interactive", "09:30", "09:30")]}),
        "spec.schedule.windows[0].end",
    ),
    (
        "preferred batch above max batch",
        _then(_set("profiles.interactive.maxBatchSize", 4)),
        "spec.profiles.interactive.preferredBatchSizes",
    ),
    (
        "slo bounds inverted",
        _set(
            "slo",
            {
                "p95LatencyMs": 50,
                "minQueueDelayMicroseconds": 9000,
                "maxQueueDelayMicroseconds": 100,
            },
        ),
        "spec.slo.minQueueDelayMicroseconds",
    ),
    (
        "release threshold above trigger",
        _set("load", {"rules": [{**RULE, "below": 300}]}),
        "spec.load.rules[0].below",
    ),
    (
        "prometheus source without url",
        _set("load", {"source": "prometheus"}),
        "spec.load.prometheus",
    ),
    (
        "profile name with capitals",
        _set("profiles", {**BASE_SPEC["profiles"], "Bulk": {"maxQueueDelayMicroseconds": 1}}),
        "spec.profiles",
    ),
    (
        "default priority without levels",
        _set("profiles.bulk.defaultPriorityLevel", 1),
        "spec.profiles.bulk.defaultPriorityLevel",
    ),
]


@pytest.mark.parametrize(
    ("mutation", "field_path"),
    [pytest.param(mutation, path, id=case) for case, mutation, path in INVALID_POLICIES],
)
def test_invalid_policy_is_rejected_at_admission_and_by_the_parser(
    mutation: Mutation, field_path: str
) -> None:
    spec = copy.deepcopy(BASE_SPEC)
    _with_schedule(spec)
    mutation(spec)

    admission = admission_errors(spec)
    assert any(error.startswith(field_path) for error in admission), admission

    with pytest.raises(documents.PolicyError) as raised:
        documents.parse_spec(spec)
    paths = [problem.path for problem in raised.value.problems]
    assert any(path.startswith(field_path) for path in paths), paths


def test_cel_rules_agree_with_python_on_a_valid_policy() -> None:
    spec = copy.deepcopy(BASE_SPEC)
    _with_schedule(spec)
    spec["load"] = {"rules": [{**RULE, "below": 100}]}
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
