"""`python -m batchpilot_docs`: write the generated reference pages (`make docs`)."""

from batchpilot_docs import generating

raise SystemExit(generating.main())
