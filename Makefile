# Two entry points, each doing all of its own set-up on a fresh machine:
#   make demo   the one-machine harvesting demo (CPU only, no cluster)
#   make test   lint, type checks and the test suite (what CI runs through .ci/run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench gpu-check clean constraints

setup: $(VENV)/.installed

# Re-installs when the metadata or the pins change. Exact versions (torch's CPU build among them) come from
# constraints.txt; the `dev` extra is every part plus the test tools.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/bubbles demo --report out/demo-report.json --timeline out/demo-timeline.png --workdir out/demo

lint: setup
	$(BIN)/ruff check .
	PYTHONPATH=benchmarks $(BIN)/lint-imports
	$(BIN)/mypy core training agent operator demo benchmarks/gpubench

# The real-API-server tier needs kube-apiserver, etcd and kubectl: found or built (once, cached) by the tools
# script. If that fails the tier is skipped with a message saying why; the rest of the suite still runs.
# The image tier builds the operator image with buildah on a Debian base made by tools/image-base.sh (cached).
# The dashboard's queries run on Debian's Prometheus (tools/prometheus-from-debian.sh).
# The cluster tier (tests/test_cluster.py) brings up a real single-node cluster with tools/node-from-debian.sh (kubelet,
# containerd, runc from Debian's packages; binaries cached like the API server's), builds the three images, installs the
# chart and runs a DeepSpeed training and FillJobs as Pods; it takes the node down again at the end.
test: lint
	KUBEBUILDER_ASSETS="$$(tools/kube-from-debian.sh || true)" BUBBLES_IMAGE_BASE="$$(tools/image-base.sh || true)" \
	  BUBBLES_PROMETHEUS="$$(tools/prometheus-from-debian.sh || true)" $(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/run_all.py --out out/bench

# On a machine with an NVIDIA GPU: pytest -m gpu, the event wake-up and the harvesting benchmark (tools/gpu-checks.sh;
# PYTHON= an interpreter with CUDA torch, DeepSpeed and bubbles[agent] when .venv's torch is the CPU build).
gpu-check:
	tools/gpu-checks.sh out/gpu-checks

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache

# Re-pin constraints.txt from a fresh resolution of the `dev` extra (torch kept at its CPU build).
constraints:
	rm -rf .venv-pin && $(PYTHON) -m venv .venv-pin
	.venv-pin/bin/python -m pip install --quiet 'torch==2.13.0' -e '.[dev]'
	{ sed -n '1,/^# Regenerate/p' constraints.txt; .venv-pin/bin/python -m pip freeze --all --exclude-editable \
	  | grep -v '^bubbles\|^pip==' | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .venv-pin
