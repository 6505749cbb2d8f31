"""The BatchPolicy API on a real API server: the CRD, printer columns, docs and admission."""

import re
from pathlib import Path

import pytest

from batchpilot_testbed import waiting
from batchpilot_testbed.kubes import Kube

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "batchpolicy.yaml"
SAMPLE = REPO / "manifests" / "batchpolicy.yaml"
INVALID = sorted((REPO / "tests" / "policies" / "invalid").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd(kube: Kube) -> None:
    """The CRD from crds/, installed and Established."""
    applied = kube.kubectl_run("apply", "--server-side", "-f", str(CRD))
    assert applied.returncode == 0, applied.stderr
    waited = kube.kubectl_run(
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        "crd/batchpolicies.batchpilot.dev",
    )
    assert waited.returncode == 0, waited.stderr


@pytest.mark.usefixtures("crd")
def test_sample_policy_is_accepted_and_listed_with_its_columns(kube: Kube, namespace: str) -> None:
    applied = kube.kubectl_run("apply", "-n", namespace, "-f", str(SAMPLE))
    assert applied.returncode == 0, applied.stderr
    assert "batchpolicy.batchpilot.dev/market-hours created" in applied.stdout

    listed = kube.kubectl_run("get", "bp", "-n", namespace)
    assert listed.returncode == 0, listed.stderr
    header = listed.stdout.splitlines()[0].split()
    assert header == ["NAME", "PROFILE", "DESIRED", "REASON", "TARGETS", "AGE"]
    assert listed.stdout.splitlines()[1].startswith("market-hours")


@pytest.mark.usefixtures("crd")
def test_api_server_applies_schema_defaults(kube: Kube, namespace: str) -> None:
    assert kube.kubectl_run("apply", "-n", namespace, "-f", str(SAMPLE)).returncode == 0
    got = kube.kubectl_run(
        "get",
        "bp",
        "market-hours",
        "-n",
        namespace,
        "-o",
        "jsonpath={.spec.dryRun} {.spec.load.source} {.spec.target.sidecarPort}",
    )
    assert got.stdout.split() == ["false", "sidecar", "9400"]


@pytest.mark.usefixtures("crd")
def test_kubectl_explain_prints_field_descriptions(kube: Kube) -> None:
    def explained() -> str | None:
        result = kube.kubectl_run("explain", "batchpolicy.spec.schedule")
        return result.stdout if result.returncode == 0 else None

    # The API server publishes a new CRD's OpenAPI a moment after it is Established.
    text = waiting.wait_for("kubectl explain batchpolicy.spec.schedule", explained)
    assert "GROUP:      batchpilot.dev" in text
    assert "IANA time zone of the windows and exception dates" in text
    assert "calendar\t<string>" in text
    assert "windows\t<[]Object>" in text
    rule = kube.kubectl_run("explain", "batchpolicy.spec.load.rules.for").stdout
    assert "How long the metric must stay past a threshold" in rule


def _normalized(message: str) -> str:
    # The API server writes map keys as [key] in CEL errors and as .key in schema errors.
    return re.sub(r"\[([A-Za-z][\w-]*)\]", r".\1", message)


@pytest.mark.usefixtures("crd")
@pytest.mark.parametrize("policy", INVALID, ids=[path.stem for path in INVALID])
def test_invalid_policy_is_rejected_at_admission_naming_the_field(
    kube: Kube, namespace: str, policy: Path
) -> None:
    expected = re.search(r"^# expect: (\S+)$", policy.read_text(), re.MULTILINE)
    assert expected is not None
    result = kube.kubectl_run("apply", "-n", namespace, "-f", str(policy))
    assert result.returncode != 0, f"accepted: {result.stdout}"
    assert "is invalid" in result.stderr, result.stderr
    assert _normalized(expected.group(1)) in _normalized(result.stderr), result.stderr
    listed = kube.kubectl_run("get", "bp", "-n", namespace, "-o", "name")
    assert listed.stdout.strip() == "", "nothing may be stored"


def test_catalog_covers_at_least_ten_invalid_policies() -> None:
    assert len(INVALID) >= 10
