"""`python -m batchpilot_docs` (part of `make docs`): the generated reference pages.

It writes `docs/reference/batchpolicy.md` (the API models), `cli.md` (the parsers),
`metrics.md` and `alerts.md` (the telemetry modules and the alert table). With `--check` it
writes nothing and names the stale pages; tests/test_docs.py runs that, as tests/test_generated.py
does for the CRD.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from batchpilot_charts import generating as charts_generating
from batchpilot_docs import commands, formats, policies, signals

REPOSITORY = Path(__file__).resolve().parents[2]
"""The source checkout this module lives in."""
REFERENCE = Path("docs") / "reference"


def rendered(repository: Path) -> dict[Path, str]:
    """Every generated page, by path, as it should read."""
    reference = repository / REFERENCE
    return {
        reference / "batchpolicy.md": policies.page(repository),
        reference / "cli.md": commands.page(),
        reference / "metrics.md": signals.metrics_page(),
        reference / "alerts.md": signals.alerts_page(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=formats.GENERATOR, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repository",
        type=Path,
        default=REPOSITORY,
        help="the batchpilot checkout (default: the one this module is in)",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming the stale pages"
    )
    arguments = parser.parse_args(argv)
    repository: Path = arguments.repository
    pages = rendered(repository)
    return charts_generating.bring_up_to_date(
        repository,
        pages,
        charts_generating.changed_files(pages),
        check=arguments.check,
        command="make docs",
    )
