# Two commands work on a fresh machine with only Python 3: `make demo` and `make test`.
# TORCH pins the CPU build for CPU-only machines; on a GPU machine use e.g. `make demo TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	IPP_NONINTERACTIVE=1 $(BIN)/workbench demo

test: $(STAMP)
	$(BIN)/ruff check .
	IPP_NONINTERACTIVE=1 $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench all

clean:
	rm -rf $(VENV) artifacts
