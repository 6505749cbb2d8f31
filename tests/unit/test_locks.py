"""The one lock (uv.lock): it holds what the pyproject.toml files ask for, its exports in
requirements/ are what it gives now, every Dockerfile installs from its export with hashes, and
this virtualenv holds exactly the lock's versions (batchpilot_harness.locks)."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from batchpilot_cluster import images
from batchpilot_harness import locks

REPO = Path(__file__).resolve().parents[2]


def project(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    return document


ROOT = project(REPO / "pyproject.toml")


def test_the_lock_holds_what_the_pyproject_files_ask_for() -> None:
    assert locks.lock_disagreement() is None


@pytest.mark.timeout(120)
def test_a_pyproject_bound_the_lock_does_not_satisfy_is_a_disagreement(tmp_path: Path) -> None:
    # The check seen failing: the checkout's projects and lock, one bound raised past the lock.
    for relative in ("pyproject.toml", "uv.lock", "README.md", "sidecar", "tools", "operator"):
        source = REPO / relative
        if source.is_dir():
            shutil.copytree(source, tmp_path / relative, ignore=shutil.ignore_patterns("*.pyc"))
        else:
            shutil.copy2(source, tmp_path / relative)
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    assert '"kopf>=1.37",' in text
    pyproject.write_text(text.replace('"kopf>=1.37",', '"kopf>=99",', 1))
    assert locks.lock_disagreement(root=tmp_path) is not None


@pytest.mark.timeout(120)
def test_every_export_is_what_the_lock_gives_now() -> None:
    assert locks.stale_exports() == [], "stale: run `make lock`"


def test_this_virtualenv_holds_the_lock_s_versions_and_nothing_else() -> None:
    assert locks.venv_differences() == [], "run `make venv`"


def test_every_image_installs_from_its_export_with_hashes() -> None:
    exported = {export.path for export in locks.EXPORTS}
    for recipe in images.IMAGES:
        dockerfile = (REPO / recipe.dockerfile).read_text()
        assert recipe.requirements in exported, recipe.name
        assert recipe.requirements in dockerfile, recipe.name
        assert "--require-hashes" in dockerfile, recipe.name
        assert (
            "pip install --no-cache-dir --require-hashes -r requirements/build.txt" in (dockerfile)
            or recipe.name == "batchpilot-triton"
        )


def test_the_operator_image_group_is_within_the_product_and_carries_no_sidecar_or_calendars() -> (
    None
):
    group = ROOT["dependency-groups"]["operator-image"]
    assert set(group) <= set(ROOT["project"]["dependencies"])
    names = {locks.canonical(locks.requirement_name(requirement)) for requirement in group}
    assert names.isdisjoint({"numpy", "nvidia-ml-py", "exchange-calendars", "tritonclient"})
    pinned = locks.pinned_in("requirements/operator-image.txt")
    assert {"numpy", "pandas", "exchange-calendars", "nvidia-ml-py"}.isdisjoint(pinned)


def test_calendars_are_an_extra_of_the_product_not_a_dependency() -> None:
    assert ROOT["project"]["optional-dependencies"]["calendars"] == ["exchange-calendars>=4.5"]
    assert not any(d.startswith("exchange-calendars") for d in ROOT["project"]["dependencies"])
    assert "exchange-calendars" in locks.pinned_in("requirements/operator-calendars.txt")


def test_every_export_pins_each_package_with_its_hashes() -> None:
    for export in locks.EXPORTS:
        entries = locks.blocks((REPO / export.path).read_text())
        assert entries, export.path
        for entry in entries:
            assert "==" in entry.splitlines()[0], entry
            assert "--hash=sha256:" in entry, entry


EXPORTED = """\
aiohttp==3.14.5 ; sys_platform == 'linux' \\
    --hash=sha256:aa \\
    --hash=sha256:bb
    # via batchpilot
numpy==1.26.4 ; sys_platform == 'linux' \\
    --hash=sha256:cc
"""


def test_pins_reads_each_entry_with_its_version() -> None:
    assert locks.pins(EXPORTED) == {"aiohttp": "3.14.5", "numpy": "1.26.4"}
    assert len(locks.blocks(EXPORTED)) == 2
    assert "# via batchpilot" in locks.blocks(EXPORTED)[0]


def test_an_unpinned_entry_is_refused() -> None:
    with pytest.raises(locks.LockError, match=re.escape("not a pinned requirement: aiohttp>=3.9")):
        locks.pins("aiohttp>=3.9\n")


def test_differences_name_other_versions_missing_and_unlocked_packages() -> None:
    locked = {"aiohttp": "3.14.5", "numpy": "1.26.4", "kopf": "1.45.2"}
    present = {"aiohttp": "3.14.5", "numpy": "2.4.6", "pytest-xdist": "3.8.0", "batchpilot": "0"}
    assert locks.differences(locked=locked, present=present, own=frozenset({"batchpilot"})) == [
        "numpy: 2.4.6 installed, the lock has 1.26.4",
        "kopf: missing (the lock has 1.45.2)",
        "pytest-xdist: 3.8.0 installed, not in the lock",
    ]
