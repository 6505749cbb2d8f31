"""The product's wheel (the root pyproject.toml, what `pip install .` and the operator's image
install) carries the operator, the sidecar and their shared layer, and no tooling: no harness,
generator, local cluster or test bed, and no command that names them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PRODUCT = {"batchpilot", "batchpilot_sidecar", "batchpilot_triton"}
TOOLING = {
    "batchpilot_harness",
    "batchpilot_charts",
    "batchpilot_cluster",
    "batchpilot_testbed",
    "batchpilot_docs",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # Built from a copy, so that the checkout gets no build/ or egg-info of it.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("operator", "sidecar"):
        shutil.copytree(
            REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("batchpilot-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.timeout(300)
def test_the_wheel_holds_the_product_packages_and_no_tooling(wheel: zipfile.ZipFile) -> None:
    packages = {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}
    assert packages == PRODUCT
    assert not any(name.split("/")[0] in TOOLING for name in wheel.namelist())


@pytest.mark.timeout(300)
def test_the_wheel_s_commands_name_no_tooling(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = (n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(entry_points).decode()
    assert "batchpilot = batchpilot.cli:main" in text
    assert "sidecar = batchpilot_sidecar.commands" in text
    assert not any(package in text for package in TOOLING), text
