"""The kind path: `python -m batchpilot_testbed.kind up|test|down` (see __main__)."""
