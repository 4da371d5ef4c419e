# One entry for everything. `make check` is what CI runs (.ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.stamp-run
DEV_STAMP := $(VENV)/.stamp-dev

.PHONY: setup setup-dev sysdeps serve check test lint fmt types bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

CONSTRAINTS := constraints/test.txt

# Runtime only: what `make serve` needs (the package with its `server` extra).
$(RUN_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[server]'
	touch $(RUN_STAMP)

# Everything the checks need: dev tools (server, mcp and deploy validators included), and
# lmcache + torch (CPU build) for the LMCache integration tests, at the tested versions.
$(DEV_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev,lmcache]'
	touch $(RUN_STAMP) $(DEV_STAMP)

setup: $(RUN_STAMP)
setup-dev: $(DEV_STAMP)

# Debian packages the test-suite talks to (real redis-server, redis-cli, redis-benchmark),
# the daemonless image builder (buildah, podman, debootstrap: tests/test_image.py) and
# systemd-analyze for the unit file.
SYSDEPS := redis-server redis-tools buildah podman debootstrap crun systemd
sysdeps:
	@command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null && \
	  command -v buildah >/dev/null && command -v debootstrap >/dev/null && \
	  command -v systemd-analyze >/dev/null || \
	  { (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSDEPS); }

# Quick start: run the server on embedded defaults (loopback, durable store in ./kvcache-data).
serve: setup
	$(BIN)/epistemic-kvcache serve

lint: setup-dev
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/ruff check src tests bench scripts

fmt: setup-dev
	$(BIN)/ruff format src tests bench scripts
	$(BIN)/ruff check --fix src tests bench scripts

types: setup-dev
	$(BIN)/mypy

test: setup-dev sysdeps
	$(BIN)/pytest

# Quick start: set up from nothing and pass every check.
check: lint types test

bench: setup-dev sysdeps
	@command -v iperf3 >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3
	$(BIN)/python -m bench.bench_store
	$(BIN)/python -m bench.bench_server
	$(BIN)/python -m bench.bench_lmcache
	$(BIN)/python -m bench.bench_engine
	$(BIN)/python -m bench.bench_context

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
