"""Integer limits within what the compiled build holds, and the twin variable known
(issue 40, item 6).

A RESP limit of 2**63 or more used to start the server (compiled framer), which then
raised OverflowError on the first connection; now every integer limit is checked at
load against `MAX_LIMIT` with an error naming the setting and the maximum. The framer
refuses such a limit itself too (both twins alike), and the maximum is one it holds: a
listener with every framer limit at `MAX_LIMIT` serves redis-py.
`EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON`, which twins.py reads, used to be warned about as
an unknown variable and then honoured.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.config import load_config
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.proto import resp_parser
from epistemic_kvcache.proto.resp_types import MAX_LIMIT
from epistemic_kvcache.shared import ServerLimits
from epistemic_kvcache.twins import PURE_BUILD_ENV, PURE_PYTHON_ENV
from helpers import compiled_twin
from servers import ServeProcess, running_listener

compiled, needs_compiled = compiled_twin("epistemic_kvcache.proto._resp_parser_c")

INT_LIMITS = [
    f.name for f in dataclasses.fields(ServerLimits) if type(getattr(ServerLimits(), f.name)) is int
]


def test_every_integer_limit_is_one_of_those_checked() -> None:
    assert {"resp_max_args", "max_block_bytes", "resp_unauthenticated_max_args"} <= set(INT_LIMITS)


@pytest.mark.parametrize("name", INT_LIMITS)
def test_a_limit_over_the_maximum_is_refused_naming_it(name: str) -> None:
    # the budgets at the maximum, so that no cross-check (block <= budget) fires first
    raised = dict.fromkeys(("max_inflight_body_bytes", "max_tenant_inflight_bytes"), MAX_LIMIT)
    raised[name] = 2**63
    with pytest.raises(ConfigurationError) as err:
        load_config(cli=raised, env={})
    assert str(err.value).startswith(f"invalid {name}: expected at most {MAX_LIMIT} (2**62")
    assert "got 9223372036854775808" in str(err.value)


@pytest.mark.parametrize("name", INT_LIMITS)
def test_the_maximum_itself_is_accepted(name: str) -> None:
    values = dict.fromkeys(("max_inflight_body_bytes", "max_tenant_inflight_bytes"), MAX_LIMIT)
    values[name] = MAX_LIMIT
    assert getattr(load_config(cli=values, env={}).limits, name) == MAX_LIMIT


def test_serve_refuses_to_start_with_a_limit_the_compiled_build_cannot_hold(
    tmp_path: Path,
) -> None:
    # what the operator saw: the server started, then the first RESP connection failed
    proc = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "serve", "--backend", "memory",
         "--persist-dir", str(tmp_path), "--addr", "127.0.0.1:0", "--resp-addr",
         "127.0.0.1:0", "--token", "t" * 24, "--resp-max-args", str(2**63)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "epistemic-kvcache serve: error: invalid resp_max_args: expected at most "
        f"{MAX_LIMIT}" in proc.stderr
    )
    assert "listening" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "twin",
    [
        pytest.param(resp_parser.RespParser, id="pure"),
        pytest.param(getattr(compiled, "RespParser", None), id="compiled", marks=needs_compiled),
    ],
)
@pytest.mark.parametrize(
    "name",
    ["max_multibulk_len", "max_bulk_bytes", "unauthenticated_max_multibulk_len",
     "unauthenticated_max_bulk_bytes", "max_inline_bytes"],
)  # fmt: skip
def test_the_framer_refuses_a_limit_over_the_maximum(twin: type, name: str) -> None:
    with pytest.raises(ValueError, match=f"invalid {name}: expected at most {MAX_LIMIT}"):
        twin(**{name: MAX_LIMIT + 1})
    assert getattr(twin(**{name: MAX_LIMIT}), name) == MAX_LIMIT


def test_a_listener_with_every_framer_limit_at_the_maximum_serves() -> None:
    limits = ServerLimits(
        max_block_bytes=MAX_LIMIT,
        resp_max_args=MAX_LIMIT,
        resp_unauthenticated_max_args=MAX_LIMIT,
        resp_unauthenticated_max_bulk_bytes=MAX_LIMIT,
    )
    with running_listener("resp", limits=limits, tokens={"tok": "default"}) as lst:
        client = redis.Redis(port=lst.port, password="tok", socket_timeout=10)
        try:
            assert client.set("k", b"v" * 100)
            assert client.get("k") == b"v" * 100
            assert client.ping()
        finally:
            client.close()


def test_the_pure_python_variable_is_known() -> None:
    for value in ("1", "fast_path", "resp_framer,store_core"):
        assert load_config(env={PURE_PYTHON_ENV: value}).warnings == ()


def test_the_build_time_variable_is_known() -> None:
    """Set where the package is built (setup.py), it may be in the server's environment
    too: known, not warned about as an unknown variable."""
    assert load_config(env={PURE_BUILD_ENV: "1"}).warnings == ()


def test_a_twin_name_that_is_no_twins_is_warned_about() -> None:
    (alone,) = load_config(env={PURE_PYTHON_ENV: "fast_pth"}).warnings
    assert alone.startswith(f"{PURE_PYTHON_ENV}: unknown twin name(s) fast_pth (every twin")
    (beside,) = load_config(env={PURE_PYTHON_ENV: "fast_path,nope"}).warnings
    assert "unknown twin name(s) nope (ignored" in beside


def test_serve_with_the_pure_python_variable_warns_of_nothing(tmp_path: Path) -> None:
    srv = ServeProcess(tmp_path, token="t" * 24, env={PURE_PYTHON_ENV: "1"})
    srv.stop()
    text = srv.text
    assert "unknown environment variable" not in text
    assert "RESP framer: pure twin (EPISTEMIC_GRAPH_KVCACHE_PURE_PYTHON is set)" in text
