# Two entry points for a fresh machine (see README.md):
#   make run    set up .venv and run the default pipeline (config/config.yaml)
#   make test   set up .venv and run the test suite (unit tests + tiny real Snakemake runs + lint)
# On a GPU box keep its CUDA build of torch: `make run TORCH=torch` (or any pip requirement).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
CORES ?= 2
SNAKEMAKE_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.kpipe-installed

.PHONY: setup run test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

test: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest

lint: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint

clean:
	rm -rf results logs .snakemake
