# The two commands a newcomer needs are `make demo` and `make test`; everything else is a step of
# theirs. Expensive things (the virtualenv, Go-built Kubernetes binaries) are cached.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: venv lint unit integration e2e test demo crds bench bench-short

# The main job: a local Triton, the demo model, a policy and load; watch it switch.
demo: venv
	$(VENV)/bin/batchpilot demo

venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,triton,torch]'
	rm -f $(VENV)/.installed-* && touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

crds: venv
	$(PY) -m batchpilot.crds crds/batchpolicy.yaml

unit: venv
	$(PY) -m pytest tests/unit

integration: venv
	$(PY) -m pytest tests/integration

# The benchmarks with their full figures, one after another (over an hour on 2 cores: the policy
# day alone is about 35 minutes); figures, JSON, Markdown and plots go to .bench/. The switch and
# scale benchmarks use this checkout's local control plane, starting one if none is up.
bench: venv k8s-bins
	$(PY) tests/benchmarks/bench_sidecar.py
	$(PY) tests/benchmarks/bench_policy.py
	$(PY) tests/benchmarks/bench_switch.py
	$(PY) tests/benchmarks/bench_scale.py

# Their short modes, as CI runs them: figures printed, nothing about speed asserted.
bench-short: venv k8s-bins
	$(PY) -m pytest tests/benchmarks -m benchmark -s

# Against a real API server: the local control plane (started and stopped by the suite), or the
# cluster $$KUBECONFIG names if it is a test cluster.
e2e: venv k8s-bins
	$(PY) -m pytest e2e --e2e

# Everything CI runs (.ci/run): linters, unit and integration tests, the e2e suite.
test: lint k8s-bins
	$(PY) -m pytest tests
	$(PY) -m pytest e2e --e2e

# The e2e control plane: Kubernetes, etcd, kwok and helm built from Go modules once per version
# into ${BATCHPILOT_CACHE:-~/.cache/batchpilot} (slow the first time), run on loopback from .run/.
.PHONY: k8s-bins cluster-up cluster-down

k8s-bins: venv
	$(PY) -m e2e.cluster build

cluster-up: venv
	$(PY) -m e2e.cluster up

cluster-down:
	$(PY) -m e2e.cluster down
