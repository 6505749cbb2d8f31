"""`python -m batchpilot_charts`: write the generated files (`make generate`)."""

from batchpilot_charts import generating

raise SystemExit(generating.main())
