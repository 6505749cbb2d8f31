"""`python -m batchpilot_docs` (part of `make docs`): the generated reference pages.

It writes `docs/reference/batchpolicy.md` (the API models), `cli.md` (the parsers),
`metrics.md` and `alerts.md` (the telemetry modules and the alert table). With `--check` it
writes nothing and names the stale pages; tests/test_docs.py runs that, as tests/test_generated.py
does for the CRD.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def stale_pages(pages: dict[Path, str]) -> list[Path]:
    return [
        path
        for path, text in pages.items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]


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
    stale = stale_pages(pages)
    for path in stale:
        name = path.relative_to(repository)
        if arguments.check:
            print(f"stale: {name}", file=sys.stderr)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(pages[path], encoding="utf-8")
            print(f"wrote: {name}", file=sys.stderr)
    if stale and arguments.check:
        print(f"run `{formats.GENERATOR}` (or `make docs`) to regenerate them", file=sys.stderr)
        return 1
    return 0
