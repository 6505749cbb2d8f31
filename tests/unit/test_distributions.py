"""The distributions: the product (pyproject.toml), the sidecar's own (sidecar/pyproject.toml,
what its image installs) and the tooling's (tools/pyproject.toml) agree, and the commands other
packages add to `batchpilot` are there."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def project(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    return document


ROOT = project(REPO / "pyproject.toml")
SIDECAR = project(REPO / "sidecar" / "pyproject.toml")
TOOLS = project(REPO / "tools" / "pyproject.toml")
ADDED_COMMANDS = {
    **ROOT["project"]["entry-points"]["batchpilot.commands"],
    **TOOLS["project"]["entry-points"]["batchpilot.commands"],
}


def test_the_sidecar_depends_on_nothing_the_whole_does_not_pin_alike() -> None:
    assert set(SIDECAR["project"]["dependencies"]) <= set(ROOT["project"]["dependencies"])


@pytest.mark.parametrize("name", ["kopf", "kubernetes", "prometheus-api-client", "pydantic"])
def test_the_sidecar_image_carries_no_operator_library(name: str) -> None:
    assert not any(d.startswith(name) for d in SIDECAR["project"]["dependencies"])


def test_the_product_distribution_finds_only_product_packages() -> None:
    found = ROOT["tool"]["setuptools"]["packages"]["find"]
    assert found["where"] == ["operator", "sidecar"]
    assert all(name.startswith(("batchpilot.", "batchpilot_sidecar", "batchpilot_triton"))
               or name == "batchpilot" for name in found["include"])  # fmt: skip


def test_the_demo_comes_from_the_tooling_not_the_product() -> None:
    assert "demo" not in ROOT["project"]["entry-points"]["batchpilot.commands"]
    assert TOOLS["project"]["entry-points"]["batchpilot.commands"]["demo"] == (
        "batchpilot_harness.demo_command"
    )


def test_both_distributions_take_their_version_from_one_place() -> None:
    for document in (ROOT, SIDECAR):
        assert "version" in document["project"]["dynamic"]
        assert document["tool"]["setuptools"]["dynamic"]["version"] == {
            "attr": "batchpilot_triton.__version__"
        }


def test_the_sidecar_distribution_holds_the_sidecar_and_the_shared_layer_only() -> None:
    found = SIDECAR["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["batchpilot_sidecar*", "batchpilot_triton*"]


@pytest.mark.parametrize(("command", "target"), sorted(ADDED_COMMANDS.items()))
def test_every_added_command_offers_what_the_cli_asks_of_it(command: str, target: str) -> None:
    module = importlib.import_module(target)
    assert isinstance(module.HELP, str)
    assert isinstance(module.DESCRIPTION, str)
    assert callable(module.add_arguments)
    assert callable(module.run)


def test_a_command_whose_package_is_not_installed_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    from batchpilot import cli

    absent = metadata.EntryPoint("demo", "batchpilot_not_installed.commands", cli.PLUGIN_GROUP)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [absent])
    assert cli.main(["demo", "--short"]) == 2
    assert "batchpilot demo: not part of this installation" in capsys.readouterr().err


def test_a_command_no_installed_distribution_adds_says_where_it_comes_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The product's own distribution (the operator's image) adds no `demo`: the tooling does.
    from importlib import metadata

    from batchpilot import cli

    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    assert cli.main(["demo"]) == 2
    error = capsys.readouterr().err
    assert "batchpilot demo: not part of this installation" in error
    assert "batchpilot's tooling" in error
