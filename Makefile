# BlockTrain developer entry points. Every target installs what it needs into .venv (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The data the tool trains on by default: WikiText-2-raw re-split (see the shared SOURCE.md).
export BLOCKTRAIN_DATA ?= $(abspath ../shared/data/wikitext/wikitext-2-raw-resplit)
RUN ?= runs/tiny
# `make run STEPS=20`: a shorter training run (default: the preset's 300 steps).
STEPS ?=

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; install it before the package so that
	# pip does not pull a CUDA build to satisfy torch>=2.4.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## run: train the `tiny` preset, evaluate it and print a sample (a few minutes on 2 CPU cores)
run: $(STAMP)
	$(VENV)/bin/blocktrain train --preset tiny --out $(RUN) --overwrite $(if $(STEPS),--steps $(STEPS))
	$(VENV)/bin/blocktrain eval $(RUN) --split test
	$(VENV)/bin/blocktrain generate $(RUN) --prompt " = Robert Boulter = " --bytes 200

## test: lint, type-check and run the default (fast) test suite
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/mypy
	# two processes, one torch thread each (tests/conftest.py): 3 min 40 s here against 6 min in one
	$(PY) -m pytest -q -n 2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/ruff format --check src tests bench tools
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
