# Two entry points, each doing all of its own set-up on a fresh machine:
#   make demo   the one-machine harvesting demo (CPU only, no cluster)
#   make test   lint, type checks and the test suite (what CI runs through .ci/run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

# Re-installs when pyproject.toml changes. torch is pinned to its CPU build (see pyproject.toml).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

demo: setup
	$(BIN)/bubbles demo --report out/demo-report.json --timeline out/demo-timeline.png --workdir out/demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy src agent operator

test: lint
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/run_all.py --out out/bench

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
