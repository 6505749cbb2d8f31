"""What the images `make images` builds hold, read back from their OCI archives: the Python
distributions each Dockerfile installed are the lock's export it installs from, at the lock's
versions, and nothing else but the image's own; the SBOM beside each archive lists the same; the
operator's and the sidecar's images stay within their sizes.

Skipped when the images are not built from the current inputs (`make images`; `make integration`
builds them first)."""

from __future__ import annotations

import json

import pytest

from batchpilot_cluster import images
from batchpilot_harness import locks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MEGABYTE = 1_000_000
SIZE_LIMITS = {"batchpilot-operator": 150 * MEGABYTE, "batchpilot-sidecar": 120 * MEGABYTE}
"""Uncompressed, as a node's containerd unpacks them (issue 45's targets)."""


def built_or_skip(recipe: images.ImageRecipe) -> images.BuiltImage:
    try:
        return images.archive(recipe.name)
    except images.ImageError as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("recipe", images.IMAGES, ids=lambda recipe: recipe.name)
def test_each_image_holds_the_lock_s_versions_of_its_export_and_nothing_else(
    recipe: images.ImageRecipe,
) -> None:
    built = built_or_skip(recipe)
    found = images.contents(built.archive, recipe.site_packages).versions()
    own = {locks.canonical(name) for name in recipe.own}
    assert own <= set(found), (own, sorted(found))
    locked = locks.pinned_in(recipe.requirements)
    assert locks.differences(locked=locked, present=found, own=frozenset(own)) == []


@pytest.mark.parametrize("recipe", images.IMAGES, ids=lambda recipe: recipe.name)
def test_each_image_s_sbom_lists_what_it_holds(recipe: images.ImageRecipe) -> None:
    built = built_or_skip(recipe)
    sbom = json.loads(images.write_sbom(recipe, built.archive).read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    listed = {
        locks.canonical(component["name"]): component["version"] for component in sbom["components"]
    }
    assert listed == images.contents(built.archive, recipe.site_packages).versions()


@pytest.mark.parametrize("name", sorted(SIZE_LIMITS))
def test_the_operator_and_sidecar_images_stay_within_their_sizes(name: str) -> None:
    built = built_or_skip(images.recipe_named(name))
    assert built.image_bytes <= SIZE_LIMITS[name], images.describe(built)


def test_the_operator_image_carries_no_calendars_numpy_or_nvml() -> None:
    recipe = images.recipe_named("batchpilot-operator")
    found = images.contents(built_or_skip(recipe).archive, recipe.site_packages).versions()
    assert {"exchange-calendars", "pandas", "numpy", "nvidia-ml-py", "tritonclient"}.isdisjoint(
        found
    )
