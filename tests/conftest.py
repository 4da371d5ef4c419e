"""Shared fixtures: generic helpers any test module may use.

Rules every test keeps (helpers in tests/helpers.py):

- **Never a released port.** A port picked by binding port 0 and closing the socket can
  be taken by anything (another bind, the source port of an outgoing connection) before
  the test uses it. A server the test starts binds port 0 itself and reports the port
  it got (`serve --addr 127.0.0.1:0` prints a `listening` line; `ServerThread` has
  `.http.port`). Where a program needs a port on its command line (redis-server, the
  lmcache server), or a test restarts a server on the same port, or needs a port where
  nothing listens, the port is held by `helpers.reserve_port()` / `helpers.held_port()`
  (a bound, non-listening SO_REUSEADDR socket) for as long as it is needed: the program
  binds it with SO_REUSEADDR, nobody else can.
- **No sleep as synchronisation.** A test waiting for something to happen polls it with a
  deadline through `helpers.eventually(predicate, timeout=..., interval=...)` (or
  `eventually_async`). A `sleep` that remains creates a delay on purpose (a slow client,
  load for a while, a random kill moment) and says so in a comment.
- **No real time for TTLs and epochs.** Stores take a `clock`; tests pass a fake clock
  they advance.
- **One server harness.** A test that needs a server starts it through tests/servers.py:
  `running_server` (the whole server in-process), `ServeProcess` (a `serve` child process
  to kill), `running_listener` (one listener over a context and store the test holds) or,
  with no socket at all, `run_in_context` + `helpers.FakeTransport` (a connection
  protocol driven bytes in, bytes out).
- **An honest time budget.** The default per-test timeout is pyproject's `timeout`; a
  test that needs more says so with `@pytest.mark.timeout(N)`, N = its time measured on
  a 2-core machine times ~3 for a loaded one.
"""

from __future__ import annotations

import importlib.util
import os
import random
import secrets

import pytest

# tests/e2e/ drives vLLM itself and runs in its own virtualenv (`make e2e`); where vLLM is
# not installed (the main virtualenv) it is not collected at all.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["e2e"]


@pytest.fixture
def rand(request: pytest.FixtureRequest) -> random.Random:
    """A seeded `random.Random` whose seed is printed (rerun with KVCACHE_TEST_SEED=<seed>)."""
    env = os.environ.get("KVCACHE_TEST_SEED")
    seed = int(env) if env else secrets.randbits(32)
    print(f"\n{request.node.nodeid}: seed={seed} (KVCACHE_TEST_SEED={seed} to replay)")
    return random.Random(seed)
