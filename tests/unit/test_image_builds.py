"""The image builder's inputs and cache (batchpilot_cluster.images): what an image's tag is a hash
of, when a run builds nothing, and how a missing tool or a failed step is reported."""

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from batchpilot_cluster import images, locations
from batchpilot_testbed import fleet

OPERATOR_LIKE = """\
ARG BASE=python:3.11-slim
FROM ${BASE} AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY --chown=1:1 src \\
     ./src
RUN pip wheel .

FROM ${BASE}
COPY --from=wheels /wheels /wheels
COPY ["data", "/data"]
# COPY ignored/ /in-a-comment
"""


@pytest.fixture
def context(tmp_path: Path) -> Path:
    root = tmp_path / "context"
    root.mkdir()
    (root / ".dockerignore").write_text("**/__pycache__\n**/*.pyc\n")
    (root / "src" / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "unrelated").mkdir()
    (root / "Dockerfile").write_text(OPERATOR_LIKE)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "README.md").write_text("readme\n")
    (root / "src" / "pkg" / "__init__.py").write_text("")
    (root / "src" / "pkg" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0")
    (root / "data" / "model.txt").write_text("weights\n")
    (root / "unrelated" / "notes.md").write_text("not copied\n")
    return root


def tag_of(context: Path, *, base: str = "localhost/batchpilot-base:aaaa") -> str:
    return images.input_tag(context=context, dockerfile="Dockerfile", base=base)


def test_copied_sources_are_the_context_paths_of_copy_lines_without_stage_copies() -> None:
    assert images.copied_sources(OPERATOR_LIKE) == ["pyproject.toml", "README.md", "src", "data"]


def test_the_project_dockerfiles_copy_what_their_images_need() -> None:
    def sources(dockerfile: str) -> list[str]:
        return images.copied_sources((locations.REPO_ROOT / dockerfile).read_text())

    assert sources("operator/Dockerfile") == [
        "requirements/build.txt",
        "requirements/operator-image.txt",
        "requirements/operator-calendars.txt",
        "pyproject.toml",
        "README.md",
        "operator/batchpilot",
        "sidecar/batchpilot_triton",
    ]
    assert sources("sidecar/Dockerfile") == [
        "requirements/build.txt",
        "requirements/sidecar-image.txt",
        "sidecar",
    ]
    assert sources("tools/batchpilot_cluster/triton.Dockerfile") == [
        "requirements/triton-server.txt",
        "requirements/triton-image.txt",
        "manifests/model-repository",
    ]


def test_every_dockerfile_takes_its_bases_as_build_arguments_defaulting_to_python_slim() -> None:
    for recipe in images.IMAGES:
        text = (locations.REPO_ROOT / recipe.dockerfile).read_text()
        froms = [line for line in text.splitlines() if line.startswith("FROM ")]
        assert "ARG BASE=python:3.11-slim" in text.splitlines(), recipe.dockerfile
        assert froms, recipe.dockerfile
        assert froms[0].split()[1] == "${BASE}", recipe.dockerfile
        assert all(line.split()[1] in ("${BASE}", "${RUNTIME_BASE}") for line in froms)
        if "${RUNTIME_BASE}" in text:
            assert "ARG RUNTIME_BASE=python:3.11-slim" in text.splitlines(), recipe.dockerfile


def test_the_operator_and_sidecar_run_on_the_runtime_base_without_a_step_that_needs_a_shell() -> (
    None
):
    for dockerfile in ("operator/Dockerfile", "sidecar/Dockerfile"):
        text = (locations.REPO_ROOT / dockerfile).read_text()
        final = text.rsplit("\nFROM ", 1)[1]
        assert final.startswith("${RUNTIME_BASE}\n"), dockerfile
        assert "\nRUN " not in final, dockerfile


def test_context_files_skip_bytecode_and_take_directories_whole(context: Path) -> None:
    files = images.context_files(context, ["src", "README.md", "data"])
    assert files == [Path("README.md"), Path("data/model.txt"), Path("src/pkg/__init__.py")]


def test_a_source_outside_the_context_is_refused(context: Path) -> None:
    with pytest.raises(images.ImageError, match="not in the build context"):
        images.context_files(context, ["../elsewhere"])


def test_the_tag_follows_copied_files_the_dockerfile_and_the_base(context: Path) -> None:
    first = tag_of(context)
    assert tag_of(context) == first
    assert len(first) == images.TAG_LENGTH

    (context / "data" / "model.txt").write_text("other weights\n")
    changed_file = tag_of(context)
    assert changed_file != first

    (context / "data" / "new.txt").write_text("a new file\n")
    added_file = tag_of(context)
    assert added_file != changed_file

    (context / "Dockerfile").write_text(OPERATOR_LIKE + "ENV X=1\n")
    changed_dockerfile = tag_of(context)
    assert changed_dockerfile != added_file

    assert tag_of(context, base="localhost/batchpilot-base:bbbb") != changed_dockerfile


def test_the_tag_ignores_files_no_copy_takes_and_bytecode(context: Path) -> None:
    first = tag_of(context)
    (context / "unrelated" / "notes.md").write_text("edited\n")
    (context / "src" / "pkg" / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"\1")
    (context / "src" / "pkg" / "module.pyc").write_bytes(b"\2")
    assert tag_of(context) == first


def test_the_tag_follows_a_file_s_executable_bit(context: Path) -> None:
    first = tag_of(context)
    (context / "data" / "model.txt").chmod(0o755)
    assert tag_of(context) != first


def test_the_hash_leaves_out_what_dockerignore_leaves_out(context: Path) -> None:
    (context / ".dockerignore").write_text("# comment\n\nsrc\n**/*.txt\n")
    assert images.context_files(context, ["src", "README.md", "data"]) == [Path("README.md")]


def test_without_dockerignore_everything_copied_counts(context: Path) -> None:
    (context / ".dockerignore").unlink()
    files = images.context_files(context, ["src"])
    assert files == [
        Path("src/pkg/__init__.py"),
        Path("src/pkg/__pycache__/__init__.cpython-311.pyc"),
    ]


def test_dockerignore_forms_the_hash_cannot_read_are_refused(context: Path) -> None:
    (context / ".dockerignore").write_text("src/pkg/*.py\n")
    with pytest.raises(images.ImageError, match="does not read"):
        images.context_files(context, ["src"])
    (context / ".dockerignore").write_text("!src\n")
    with pytest.raises(images.ImageError, match="does not read"):
        images.context_files(context, ["src"])


def test_the_repository_s_dockerignore_keeps_environments_and_bytecode_out() -> None:
    patterns = images.ignore_patterns(locations.REPO_ROOT)
    assert {".venv", ".git", ".run", "**/__pycache__", "**/*.pyc"} <= set(patterns)
    files = images.context_files(locations.REPO_ROOT, ["operator/batchpilot"])
    assert files
    assert not [f for f in files if "__pycache__" in f.parts or f.suffix == ".pyc"]


def test_the_base_recipe_key_changes_with_its_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    key = images.base_recipe_key()
    monkeypatch.setattr(images, "BASE_PACKAGES", (*images.BASE_PACKAGES, "curl"))
    assert images.base_recipe_key() != key


def test_the_base_is_python_slim_s_stand_in() -> None:
    argv = images.base_argv(Path("/out.tar"))
    assert argv[0] == "mmdebstrap"
    included = next(a for a in argv if a.startswith("--include=")).removeprefix("--include=")
    assert {"python3", "python3-pip", "python3-venv", "libpython3.11"} <= set(included.split(","))
    assert any("EXTERNALLY-MANAGED" in argument for argument in argv)
    assert argv[-3:] == [images.BASE_SUITE, "/out.tar", images.BASE_MIRROR]


def test_the_runtime_base_is_extracted_python_without_a_shell_or_pip() -> None:
    argv = images.runtime_argv(Path("/out.tar"))
    assert "--variant=extract" in argv
    included = next(a for a in argv if a.startswith("--include=")).removeprefix("--include=")
    assert set(included.split(",")) == {
        "python3.11-minimal", "libpython3.11-stdlib", "ca-certificates", "tzdata",
    }  # fmt: skip
    hooks = " ".join(a for a in argv if a.startswith("--extract-hook="))
    assert "ca-certificates.crt" in hooks
    assert "python3" in hooks
    assert images.RUNTIME_BASE.key() != images.BUILD_BASE.key()
    assert images.RUNTIME_BASE.tarball_path() != images.BUILD_BASE.tarball_path()


def test_an_image_gets_the_bases_its_dockerfile_declares_and_no_other() -> None:
    bases = {"BASE": "localhost/b:1", "RUNTIME_BASE": "localhost/r:2"}
    assert images.build_arguments(bases, OPERATOR_LIKE) == {"BASE": "localhost/b:1"}
    both = "ARG BASE=x\nARG RUNTIME_BASE=y\nARG OTHER=z\nFROM ${BASE}\n"
    assert images.build_arguments(bases, both) == bases


def layer(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))
    return buffer.getvalue()


def test_contents_names_each_distribution_with_its_version_and_the_bytes_of_its_files(
    tmp_path: Path,
) -> None:
    site = "opt/app/lib/python3.11/site-packages"
    base = layer({"usr/bin/python3.11": b"x" * 5000})
    first = layer({
        f"{site}/pkg_one/__init__.py": b"a" * 100,
        f"{site}/pkg_one-1.0.dist-info/METADATA": b"Name: Pkg_One\nVersion: 1.0\n\nName: body",
        f"{site}/pkg_one-1.0.dist-info/RECORD": (
            b"pkg_one/__init__.py,sha256=x,100\n"
            b"pkg_one-1.0.dist-info/METADATA,,\n../../../bin/one,,\n"
        ),
    })  # fmt: skip
    second = layer({
        f"{site}/pkg_one/__pycache__/__init__.cpython-311.pyc": b"c" * 50,
        f"{site}/two.py": b"t" * 10,
        f"{site}/two-2.0.dist-info/METADATA": b"Name: two\nVersion: 2.0\n",
        f"{site}/two-2.0.dist-info/RECORD": b"two.py,,\n",
    })  # fmt: skip
    archive = tmp_path / "image.oci.tar"
    oci_archive(archive, [base, first, second])
    found = images.contents(archive, site)
    assert found.versions() == {"pkg-one": "1.0", "two": "2.0"}
    one, two = found.distributions
    metadata_bytes = len(b"Name: Pkg_One\nVersion: 1.0\n\nName: body")
    record_bytes = len(
        b"pkg_one/__init__.py,sha256=x,100\npkg_one-1.0.dist-info/METADATA,,\n../../../bin/one,,\n"
    )
    assert one.size == 100 + 50 + metadata_bytes + record_bytes
    assert two.name == "two"
    assert found.site_packages_bytes > one.size + two.size - 1
    assert images.ImageContents.from_json(json.loads(json.dumps(found.to_json()))) == found


@pytest.mark.timeout(120)
def test_the_sbom_lists_the_image_s_distributions_and_nothing_of_this_interpreter_s_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = "opt/app/lib/python3.11/site-packages"
    metadata = b"Metadata-Version: 2.1\nName: Pkg_One\nVersion: 1.0\n"
    archive = tmp_path / "one-0123456789abcdef.oci.tar"
    oci_archive(archive, [layer({f"{site}/pkg_one-1.0.dist-info/METADATA": metadata})])
    # A distribution on PYTHONPATH (a checkout's egg-info, say) is not the image's.
    stray = tmp_path / "stray" / "stray-9.9.dist-info"
    stray.mkdir(parents=True)
    (stray / "METADATA").write_text("Metadata-Version: 2.1\nName: stray\nVersion: 9.9\n")
    monkeypatch.setenv("PYTHONPATH", str(stray.parent))
    monkeypatch.setenv("BATCHPILOT_CACHE", str(tmp_path / "cache"))
    recipe = images.ImageRecipe(name="one", dockerfile="Dockerfile", site_packages=site)
    sbom = json.loads(images.write_sbom(recipe, archive).read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    assert [(c["name"], c["version"]) for c in sbom["components"]] == [("Pkg_One", "1.0")]


def oci_archive(path: Path, layers: list[bytes]) -> int:
    """An OCI archive with gzip layers; returns their unpacked size."""
    blobs: dict[str, bytes] = {}

    def add(content: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(content).hexdigest()
        blobs[digest] = content
        return digest

    descriptors = [
        {
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": add(gzip.compress(layer)),
            "size": 0,
        }
        for layer in layers
    ]
    manifest = add(json.dumps({"schemaVersion": 2, "layers": descriptors}).encode())
    index = json.dumps({"schemaVersion": 2, "manifests": [{"digest": manifest}]}).encode()
    with tarfile.open(path, "w") as tar:
        for name, content in [
            ("index.json", index),
            *((f"blobs/{d.replace(':', '/')}", c) for d, c in blobs.items()),
        ]:
            member = tarfile.TarInfo(name)
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))
    return sum(len(layer) for layer in layers)


def test_unpacked_bytes_adds_up_the_layers_uncompressed(tmp_path: Path) -> None:
    archive = tmp_path / "image.oci.tar"
    expected = oci_archive(archive, [b"a" * 100_000, bytes(range(256)) * 999])
    assert images.unpacked_bytes(archive) == expected


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("BATCHPILOT_CACHE", str(root))
    for base in images.BASES:
        base.tarball_path().parent.mkdir(parents=True, exist_ok=True)
        base.tarball_path().write_bytes(f"{base.name}'s root filesystem".encode())
    monkeypatch.setattr(images, "require_tools", lambda: None)
    monkeypatch.setattr(images, "import_base", lambda *args: None)
    return root


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The images build() builds, each recorded and archived as the real build_image does."""
    built_names: list[str] = []

    def build_image(
        buildah: images.Buildah,
        recipe: images.ImageRecipe,
        *,
        bases: dict[str, str],
        tag: str,
        context: Path,
    ) -> images.BuiltImage:
        built_names.append(recipe.name)
        built = images.BuiltImage(
            name=recipe.name,
            reference=images.reference(recipe.name, tag),
            archive=images.archive_path(recipe.name, tag),
            image_bytes=1,
            archive_bytes=1,
            build_seconds=1.0,
            cached=False,
        )
        built.archive.write_bytes(b"archive")
        built.archive.with_suffix(".json").write_text(json.dumps(built.to_json()))
        return built

    monkeypatch.setattr(images, "build_image", build_image)
    return built_names


def test_a_second_run_with_unchanged_inputs_builds_nothing_and_a_change_rebuilds_that_image(
    cache: Path, context: Path, builds: list[str]
) -> None:
    (context / "other.Dockerfile").write_text('FROM ${BASE}\nCOPY ["README.md", "/r"]\n')
    recipes = (
        images.ImageRecipe(name="one", dockerfile="Dockerfile"),
        images.ImageRecipe(name="two", dockerfile="other.Dockerfile"),
    )
    first = images.build(context=context, recipes=recipes)
    assert builds == ["one", "two"]
    assert [image.cached for image in first] == [False, False]

    second = images.build(context=context, recipes=recipes)
    assert builds == ["one", "two"]
    assert [image.cached for image in second] == [True, True]
    assert [image.reference for image in second] == [image.reference for image in first]
    assert "cached" in images.describe(second[0])

    (context / "src" / "pkg" / "__init__.py").write_text("VERSION = 2\n")
    third = images.build(context=context, recipes=recipes)
    assert builds == ["one", "two", "one"]
    assert third[0].reference != first[0].reference
    assert third[1] == second[1]
    assert images.archive("one", context=context, recipes=recipes).archive == third[0].archive
    assert images.last_built("one").reference == third[0].reference


def test_an_archive_without_its_record_is_built_again(
    cache: Path, context: Path, builds: list[str]
) -> None:
    recipes = (images.ImageRecipe(name="one", dockerfile="Dockerfile"),)
    (built,) = images.build(context=context, recipes=recipes)
    built.archive.with_suffix(".json").unlink()  # as a push interrupted before the record
    (again,) = images.build(context=context, recipes=recipes)
    assert builds == ["one", "one"]
    assert not again.cached


def test_only_the_newest_archives_of_an_image_are_kept(cache: Path) -> None:
    root = images.images_root()
    for age, tag in enumerate(["0" * 16, "1" * 16, "2" * 16, "3" * 16]):
        for path in (images.archive_path("one", tag), images.archive_path("one-two", tag)):
            path.write_bytes(b"archive")
            path.with_suffix(".json").write_text("{}")
            os.utime(path, (1000 - age, 1000 - age))
    removed = images.prune_archives("one", keep=2)
    assert removed == [images.archive_path("one", "2" * 16), images.archive_path("one", "3" * 16)]
    left = sorted(path.name for path in root.iterdir() if path.name.startswith("one-0"))
    assert left == ["one-0000000000000000.oci.json", "one-0000000000000000.oci.tar"]
    assert images.archive_path("one", "1" * 16).exists()
    assert not images.archive_path("one", "3" * 16).with_suffix(".json").exists()
    assert len(list(root.glob("one-two-*.oci.tar"))) == 4


def test_unknown_image_names_are_refused(cache: Path) -> None:
    with pytest.raises(images.ImageError, match="unknown images: nope"):
        images.build(["nope"])


def test_an_image_not_built_from_the_current_inputs_says_how_to_build_it(
    cache: Path, context: Path, builds: list[str]
) -> None:
    recipes = (images.ImageRecipe(name="one", dockerfile="Dockerfile"),)
    with pytest.raises(
        images.ImageError, match=r"one: not built .*python -m batchpilot_cluster images"
    ):
        images.archive("one", context=context, recipes=recipes)
    images.build(context=context, recipes=recipes)
    (context / "README.md").write_text("changed\n")
    with pytest.raises(images.ImageError, match=r"one: not built from the current inputs"):
        images.archive("one", context=context, recipes=recipes)
    with pytest.raises(images.ImageError, match=r"no image built yet"):
        images.last_built("two")


def test_a_missing_tool_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(images.ImageError, match=r"^buildah is not installed") as raised:
        images.require_tools()
    assert "\n" not in str(raised.value)


def test_a_failed_step_names_the_image_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "one.log"
    script = "import sys; print('compiling', flush=True); sys.exit('broken wheel')"
    argv = [sys.executable, "-c", script]
    with pytest.raises(images.ImageError) as raised:
        images.run_logged(argv, what="one", log=log, timeout=30, env={})
    assert str(raised.value) == f"one: {sys.executable} failed (exit 1); log: {log}"
    assert log.read_text().splitlines()[-2:] == ["compiling", "broken wheel"]
    identify = [sys.executable, "-c", "print('an id')"]
    output = images.run_logged(identify, what="one", log=log, timeout=30, env={}, capture=True)
    assert output == "an id\n"


@pytest.mark.timeout(20)
def test_a_step_that_hangs_is_stopped_and_named(tmp_path: Path) -> None:
    log = tmp_path / "one.log"
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(images.ImageError, match=r"one: timed out after 1 s; log: "):
        images.run_logged(argv, what="one", log=log, timeout=1, env={})


def test_e2e_triton_pods_run_the_deployment_s_tritonserver_command() -> None:
    """In the e2e suite the Triton image runs what manifests/triton-deployment.yaml runs."""
    documents = yaml.safe_load_all(
        (locations.REPO_ROOT / "manifests" / "triton-deployment.yaml").read_text()
    )
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    (container,) = (
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "triton"
    )
    placement = fleet.Placement(triton_image="triton:0", sidecar_image="sidecar:0")
    pod = fleet.triton_pod(
        "t", placement=placement, labels={}, gated=False, repository_secret="credential"
    )
    assert pod.spec is not None
    (triton,) = (c for c in pod.spec.containers if c.name == "triton")
    assert triton.command == container["command"]
    assert triton.args == container["args"]
    assert [variable.name for variable in triton.env or []] == ["TRITON_REPOSITORY_TOKEN"]


def test_e2e_triton_pods_take_their_models_and_grpc_age_as_tritonserver_flags() -> None:
    arguments = fleet.tritonserver_arguments(
        models=["gpu_sim", "other-1"], grpc_max_connection_age_ms=500, locked=False
    )
    assert "--load-model=gpu_sim" in arguments
    assert "--load-model=other-1" in arguments
    assert "--grpc-max-connection-age=500" in arguments
    assert not any("restricted" in argument for argument in arguments)


def test_the_repository_s_tags_ignore_what_building_its_packages_leaves_behind() -> None:
    """`pip wheel ./sidecar` (a test does it) leaves sidecar/build and an egg-info: the image
    built before must still be the current one."""
    ignore = images.ignore_patterns(locations.REPO_ROOT)
    for left in ("sidecar/build/lib/batchpilot_sidecar/app.py", "sidecar/dist/x.whl",
                 "sidecar/batchpilot_sidecar.egg-info/PKG-INFO"):  # fmt: skip
        assert images.ignored(Path(left), ignore), left
    assert not images.ignored(Path("sidecar/batchpilot_sidecar/app.py"), ignore)
