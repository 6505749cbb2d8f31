"""`python -m batchpilot`: the same as the `batchpilot` command."""

from batchpilot import cli

raise SystemExit(cli.main())
