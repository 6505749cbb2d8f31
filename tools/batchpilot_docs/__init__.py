"""The documentation site's generated pages and its build hooks.

The reference pages under `docs/reference/` that must never drift from the code are written
from the code's one definition: the BatchPolicy fields from the API models (`policies`), the
command line from its argparse parsers (`commands`), the metrics and alerts from the telemetry
modules and the alert table (`signals`). `generating` writes them (`make docs`), and with
`--check` names the stale ones (tests/test_docs.py). `site_hooks` lets MkDocs publish the
benchmarks' own output files beside the pages that cite them, without a copy in `docs/`.
"""
