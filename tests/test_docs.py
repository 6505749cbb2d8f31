"""The documentation site is checked like code.

- The reference pages generated from the code (`python -m batchpilot_docs`) are current.
- The site builds with MkDocs' warnings as errors: a broken internal link or anchor, or a page
  left out of the navigation, fails it.
- Every command the getting-started and tutorial pages show is run: `batchpilot explain` here,
  in process, its output compared with the page's; the rest by the test named for it.
- Headless Chromium (Debian's, from `make deps`) loads the built home page and the BatchPolicy
  reference from a server on loopback, and the pages show their title, navigation and a field.
  Without Chromium these tests fail rather than skip, as tests/test_generated.py does without
  helm: a skip would let a broken site through.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from batchpilot import cli
from batchpilot.api import crds, documents
from batchpilot.api.v1alpha1 import specs
from batchpilot_docs import generating, policies

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SHOWN_COMMANDS = [
    *sorted((DOCS / "getting-started").glob("*.md")),
    DOCS / "tutorials" / "trading-day.md",
]
RUN_ELSEWHERE = {
    # command shown: (the test that runs it, what that test runs)
    "make demo": ("tests/integration/test_demo.py", '"demo", "--short"'),
    "make test": (".ci/run", "make test"),
}
"""Shown commands too slow for this suite, and the tests that run them."""
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        capture_output=True, text=True, timeout=100, check=False, cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_no_generated_page_is_stale(capsys: pytest.CaptureFixture[str]) -> None:
    checked = generating.main(["--check", "--repository", str(REPO)])
    assert checked == 0, capsys.readouterr().err


@pytest.mark.timeout(60)
def test_generate_writes_every_page_and_check_names_a_stale_one_without_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(REPO / "manifests" / "policies", tmp_path / "manifests" / "policies")
    shutil.copy(REPO / "manifests" / "batchpolicy.yaml", tmp_path / "manifests")
    (tmp_path / "docs" / "examples").mkdir(parents=True)
    shutil.copy(REPO / policies.EVERY_FIELD, tmp_path / policies.EVERY_FIELD)
    arguments = ["--repository", str(tmp_path)]

    assert generating.main(arguments) == 0
    assert "wrote: docs/reference/batchpolicy.md" in capsys.readouterr().err
    assert generating.main([*arguments, "--check"]) == 0

    reference = tmp_path / "docs" / "reference" / "metrics.md"
    reference.write_text("# Metrics\n")
    assert generating.main([*arguments, "--check"]) == 1
    complaint = capsys.readouterr().err
    assert "stale: docs/reference/metrics.md" in complaint
    assert "make docs" in complaint
    assert reference.read_text() == "# Metrics\n"


def test_the_reference_names_every_field_with_its_bounds_and_rules() -> None:
    reference = (DOCS / "reference" / "batchpolicy.md").read_text(encoding="utf-8")
    assert "### `spec.rollout.canary` {#spec-rollout-canary}" in reference
    row = next(line for line in reference.splitlines() if line.startswith("| `analysisSeconds`"))
    assert "| integer | `120` | `10` to `3600` |" in row
    assert "defaultProfile must name one of spec.profiles (reported at `spec.defaultProfile`)" in (
        reference
    )


def test_every_field_of_the_spec_has_an_example_that_the_api_accepts() -> None:
    for document in yaml.safe_load_all((REPO / policies.EVERY_FIELD).read_text("utf-8")):
        documents.parse_document(document)
    samples = policies.sample_values(REPO)
    schema = crds.openapi_schema(specs.BatchPolicySpec)
    leaves = [
        f"{section.path}.{field}"
        for section in policies.objects("spec", schema)
        for field, child in section.schema["properties"].items()
        if "properties" not in child
    ]
    assert "spec.rollout.canary.onInconclusive" in leaves
    missing = [path for path in leaves if path not in samples]
    assert not missing, f"no example in manifests/ or {policies.EVERY_FIELD}: {missing}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = tmp_path_factory.mktemp("site")
    finished = mkdocs_build(REPO / "mkdocs.yml", built)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return built


@pytest.mark.timeout(120)
def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "reference" / "batchpolicy" / "index.html").exists()
    # The benchmarks' own plots, published from tests/benchmarks/results by the hook.
    assert (site / "benchmarks" / "results" / "canary.png").exists()


@pytest.mark.timeout(60)
def test_a_broken_internal_link_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](other.md#nowhere)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    config = re.sub(r"(?ms)^hooks:.*?(?=^\S)|^nav:.*", "", config)
    (tmp_path / "mkdocs.yml").write_text(config + "nav: [index.md, other.md]\n")

    finished = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")

    assert finished.returncode != 0
    assert "does not contain an anchor '#nowhere'" in finished.stderr


def shown_commands(page: Path) -> Iterator[tuple[str, list[str]]]:
    """Each command a page shows, with the output lines it shows after it (console blocks)."""
    for language, block in re.findall(r"(?ms)^```(\w+)\n(.*?)^```", page.read_text("utf-8")):
        if language == "sh":
            for line in block.splitlines():
                command = line.split("#", 1)[0].strip()
                if command:
                    yield command, []
        elif language == "console":
            for chunk in re.split(r"(?m)^\$ ", block)[1:]:
                command, *output = chunk.splitlines()
                yield command, output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page", SHOWN_COMMANDS, ids=lambda page: page.stem)
def test_every_command_shown_is_run(
    page: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    commands = list(shown_commands(page))
    if not commands:
        assert "\n```" not in page.read_text("utf-8"), f"{page.name}: a block of an unknown kind"
    for command, shown in commands:
        if command in RUN_ELSEWHERE:
            test, runs = RUN_ELSEWHERE[command]
            assert runs in (REPO / test).read_text(encoding="utf-8"), (command, test)
            continue
        program, *arguments = shlex.split(command)
        unknown = f"{page.name} shows `{command}`: run it here or name the test that does"
        assert program == "batchpilot", unknown
        assert arguments[0] == "explain", unknown
        assert cli.main(arguments) == 0, command
        printed = capsys.readouterr().out.splitlines()
        expected = [line for line in shown if line.strip() != "..."]
        missing = [line for line in expected if line not in printed]
        assert not missing, f"`{command}` no longer prints what {page.name} shows: {missing}"


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass


def dump_dom(url: str, profile: Path) -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: run `make deps` (Debian's chromium package)")
    finished = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
        capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-2000:]
    return finished.stdout


@pytest.mark.timeout(120)
def test_a_browser_shows_the_home_page_and_a_field_of_the_reference(
    served: str, tmp_path: Path
) -> None:
    home = dump_dom(f"{served}/", tmp_path / "home-profile")
    assert "<title>batchpilot</title>" in home
    assert navigation_sections(home) == [
        "Getting started", "Tutorials", "How-to guides", "Concepts", "Reference", "Benchmarks",
        "The benchmarks' own summaries", "Development",
    ]  # fmt: skip
    assert 'href="reference/batchpolicy/"' in home

    reference = dump_dom(f"{served}/reference/batchpolicy/", tmp_path / "reference-profile")
    assert "<title>BatchPolicy - batchpilot</title>" in reference
    assert '<h3 id="spec-rollout-canary">' in reference
    row = re.search(r"(?s)<tr>\s*<td><code>analysisSeconds</code></td>(.*?)</tr>", reference)
    assert row is not None
    assert "<td>integer</td>" in row.group(1)
    assert "<td><code>120</code></td>" in row.group(1)


def navigation_sections(page: str) -> list[str]:
    """The titles of the navigation's sections, as the primary navigation shows them."""
    labels = re.findall(
        r'(?s)<label class="md-nav__link" for="__nav_\d+(?:_\d+)?" id="__nav_[\d_]+_label".*?'
        r'<span class="md-ellipsis">\s*(.*?)\s*</span>',
        page,
    )
    return list(dict.fromkeys(labels))
