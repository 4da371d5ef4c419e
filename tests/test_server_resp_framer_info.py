"""Which twins the server runs is visible: `INFO server`'s `kvcache_resp_framer`,
`kvcache_store_core` and `kvcache_fast_path`, and a log line at start for each
(docs/architecture.md, issue 27)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.proto import resp_framer
from epistemic_kvcache.server.resp import fast
from epistemic_kvcache.store import core
from servers import running_server

TOKEN = "framer-token-0123456789"


def test_info_and_the_log_name_the_running_twin(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epistemic_kvcache.server")
    with running_server(tmp_path, backend="memory", tokens={TOKEN: "default"}) as srv:
        resp = srv.handle.resp
        assert resp is not None
        with redis.Redis(port=resp.port, password=TOKEN, socket_timeout=30) as r:
            info = r.info("server")
    assert info["kvcache_resp_framer"] == resp_framer.IMPLEMENTATION
    lines = [m for m in caplog.messages if m.startswith("RESP framer: ")]
    assert lines, caplog.messages
    assert lines[0].startswith(f"RESP framer: {resp_framer.IMPLEMENTATION} twin")
    assert info["kvcache_store_core"] == core.IMPLEMENTATION
    assert f"store hot core: {core.IMPLEMENTATION} twin" in "\n".join(caplog.messages)
    assert info["kvcache_fast_path"] == fast.IMPLEMENTATION
    assert f"RESP fast path: {fast.IMPLEMENTATION} twin" in "\n".join(caplog.messages)
