"""The kind path: `python -m e2e.kind up|test|down` (see __main__)."""
