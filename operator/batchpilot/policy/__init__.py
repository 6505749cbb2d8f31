"""The pure core: the decision engine (`decisions.decide`) and what it reasons with: schedules,
exchange sessions, load rules, lead times, which Pods a policy governs, and profiles rendered into
Triton's configuration. It decides on the API's types (`batchpilot.api`).

Nothing in this package performs I/O or reads the clock; import-linter enforces that it never
imports Kubernetes, Triton or network libraries.
"""
