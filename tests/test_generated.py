"""The generated files: one generator writes them all, and none of them is stale.

`make generate` (batchpilot_charts.generating) writes the CRD, the chart's copy of `crds/`, the
chart's alert rules and dashboard, and the plain install and RBAC manifests. The manifests need
helm, from `make k8s-bins`, which `make test` runs before these tests: without it they fail
rather than skip, since a skip would let a stale file through.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from batchpilot_charts import generating
from batchpilot_cluster import locations

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def helm() -> Path:
    built = locations.bin_dir() / "helm"
    if not built.exists():
        pytest.fail(f"no helm at {built}: run `make k8s-bins`")
    return built


@pytest.mark.timeout(120)
def test_no_generated_file_is_stale(helm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checked = generating.main(["--check", "--helm", str(helm), "--repository", str(REPO)])
    assert checked == 0, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_generate_writes_every_file_and_check_names_a_stale_one_without_writing(
    helm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for folder in ("crds", "charts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    gone = tmp_path / "charts" / "batchpilot" / "crds" / "gone.yaml"
    gone.write_text("# a copy of a CRD no longer in crds/\n")
    arguments = ["--helm", str(helm), "--repository", str(tmp_path)]

    assert generating.main(arguments) == 0
    written = capsys.readouterr().err
    assert "wrote: manifests/install.yaml" in written
    assert "removed: charts/batchpilot/crds/gone.yaml" in written
    assert not gone.exists()
    assert generating.main([*arguments, "--check"]) == 0

    dashboard = tmp_path / "charts" / "batchpilot" / "files" / "dashboard.json"
    dashboard.write_text("{}")
    assert generating.main([*arguments, "--check"]) == 1
    complaint = capsys.readouterr().err
    assert "stale: charts/batchpilot/files/dashboard.json" in complaint
    assert "make generate" in complaint
    assert dashboard.read_text() == "{}"
