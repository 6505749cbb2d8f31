"""End-to-end tests against a real Kubernetes API server (``pytest --e2e``)."""
