# The two commands a newcomer needs are `make demo` and `make test`; everything else is a step of
# theirs. Expensive things (the virtualenv, Go-built Kubernetes binaries) are cached.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: venv lint unit test crds

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

test: lint
	$(PY) -m pytest tests

# The e2e control plane: Kubernetes, etcd, kwok and helm built from Go modules once per version
# into ${BATCHPILOT_CACHE:-~/.cache/batchpilot} (slow the first time), run on loopback from .run/.
.PHONY: k8s-bins cluster-up cluster-down

k8s-bins: venv
	$(PY) -m e2e.cluster build

cluster-up: venv
	$(PY) -m e2e.cluster up

cluster-down:
	$(PY) -m e2e.cluster down
