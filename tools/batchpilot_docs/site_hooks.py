"""MkDocs hooks (mkdocs.yml `hooks:`): files the site publishes from where they already live.

The benchmarks write their plots and Markdown summaries to `tests/benchmarks/results/` (`make
bench` with `--publish`), and the dashboard's picture is `charts/batchpilot/dashboard.png`; the
pages cite them as `benchmarks/results/...` and `assets/dashboard.png`. Publishing them from
their one place keeps a second copy, which would go stale, out of `docs/`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

REPOSITORY = Path(__file__).resolve().parents[2]
RESULTS = REPOSITORY / "tests" / "benchmarks" / "results"
PUBLISHED = {
    "assets/dashboard.png": REPOSITORY / "charts" / "batchpilot" / "dashboard.png",
    **{f"benchmarks/results/{path.name}": path for path in sorted(RESULTS.glob("*"))},
}


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    for uri, path in PUBLISHED.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
