# One entry for everything. `make check` is what CI runs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup sysdeps serve check test lint fmt types bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,lmcache]'
	touch $(STAMP)

setup: $(STAMP)

# Debian packages the test-suite talks to (real redis-server, redis-cli, redis-benchmark).
sysdeps:
	@command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null || \
	  { (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools; }

# Quick start: run the server on embedded defaults (loopback, durable store in ./kvcache-data).
serve: setup
	$(BIN)/epistemic-kvcache serve

lint: setup
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/ruff check src tests bench scripts

fmt: setup
	$(BIN)/ruff format src tests bench scripts
	$(BIN)/ruff check --fix src tests bench scripts

types: setup
	$(BIN)/mypy

test: setup sysdeps
	$(BIN)/pytest

# Quick start: set up from nothing and pass every check.
check: lint types test

bench: setup sysdeps
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
