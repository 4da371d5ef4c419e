"""`epistemic-kvcache mcp` driven by the MCP SDK's own client, against a real server.

Both transports run as real subprocesses of the command: stdio (the caller's token in its
environment) and streamable HTTP (each request's bearer token). Two tenants show that a
tool never has more rights than the token it was called with. Set
KVCACHE_MCP_TRANSCRIPT=<file> to keep the JSON transcript of the stdio session.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import held_port

pytest.importorskip("mcp")

from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from epistemic_kvcache.client import EpistemicGraphKVBackend, KvCacheConfig
from epistemic_kvcache.server.app import ServerHandle
from servers import running_server

TOKEN_A = "a" * 40
TOKEN_B = "b" * 40


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    tokens = {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}
    with running_server(tmp_path_factory.mktemp("kv"), tokens=tokens, resp=False) as srv:
        yield srv.handle


def _env(url: str, token: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("EPISTEMIC_GRAPH_KVCACHE_") and k != "GRAPH_SERVICE_PERSIST_DIR"
    }
    env["EPISTEMIC_GRAPH_KVCACHE_URL"] = url
    if token is not None:
        env["EPISTEMIC_GRAPH_KVCACHE_TOKEN"] = token
    return env


def _result(res: Any) -> dict[str, Any]:
    """A CallToolResult as plain data: the structured result, or the error text."""
    if res.is_error:
        return {"error": " ".join(getattr(c, "text", "") for c in res.content)}
    data = res.structured_content
    if isinstance(data, dict) and set(data) == {"result"}:
        data = data["result"]
    return dict(data)


class Session:
    """Records every call for the transcript."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transcript: list[dict[str, Any]] = []

    async def call(self, tool: str, **args: Any) -> dict[str, Any]:
        res = _result(await self.client.call_tool(tool, args))
        self.transcript.append({"call": tool, "arguments": args, "result": res})
        return res


def _seed(url: str, token: str, items: dict[str, bytes]) -> None:
    with EpistemicGraphKVBackend(KvCacheConfig(base_url=url, token=token)) as c:
        for k, v in items.items():
            c.put(k, v)


def test_stdio_tools_against_a_real_server(kv: ServerHandle, tmp_path: Path) -> None:
    url = kv.http_url
    _seed(url, TOKEN_A, {"model@1": b"x" * 1000, "model@2": b"y" * 2000, "other": b"z"})
    _seed(url, TOKEN_B, {"model@b-secret": b"b" * 10})
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "epistemic_kvcache", "mcp"],
        env=_env(url, TOKEN_A),
        cwd=str(tmp_path),
    )

    async def scenario() -> list[dict[str, Any]]:
        async with Client(params, read_timeout_seconds=60) as client:
            listed = await client.list_tools()
            names = sorted(t.name for t in listed.tools)
            assert names == ["graph_fork", "graph_kv_checkpoint", "graph_kvcache"]
            s = Session(client)
            s.transcript.append({"list_tools": names})

            stats = await s.call("graph_kvcache", action="stats")
            assert stats["namespace"] == "tenant-a"
            assert stats["total_refs"] == 3
            ls = await s.call("graph_kvcache", action="list", prefix="model@", limit=1)
            assert ls == {"keys": ["model@1"], "next_after": "model@1"}
            ls = await s.call("graph_kvcache", action="list", prefix="model@", after="model@1")
            assert ls == {"keys": ["model@2"], "next_after": None}  # never tenant-b's keys
            ex = await s.call("graph_kvcache", action="exists", key="model@2")
            assert ex == {"key": "model@2", "exists": True, "size": 2000}
            assert (await s.call("graph_kvcache", action="exists", key="model@b-secret"))[
                "exists"
            ] is False
            bad = await s.call("graph_kvcache", action="exists")
            assert "needs a key" in bad["error"]

            snap = (await s.call("graph_fork", action="snapshot", prefix="model@"))["snapshot"]
            assert snap["keys"] == 2
            branch = (await s.call("graph_fork", action="fork", snapshot_id=snap["id"]))["branch"]
            assert branch["snapshot_id"] == snap["id"]
            got = await s.call("graph_fork", action="branch", branch_id=branch["id"])
            assert got["branch"]["id"] == branch["id"]
            both = await s.call("graph_fork", action="list")
            assert [x["id"] for x in both["snapshots"]] == [snap["id"]]
            assert [x["id"] for x in both["branches"]] == [branch["id"]]
            missing = await s.call("graph_fork", action="fork", snapshot_id="nope")
            assert "no snapshot" in missing["error"]

            blob = base64.b64encode(b"kv-state" * 100).decode()
            made = await s.call(
                "graph_kv_checkpoint",
                action="create",
                model="meta-llama/Llama-3-8B",
                engine_version="0.9.0",
                prefix_digest="ab" * 32,
                blob_base64=blob,
                metadata={"note": "after system prompt"},
            )
            cid = made["checkpoint"]["id"]
            assert made["checkpoint"]["tenant"] == "tenant-a"  # from the token, not the caller
            listed_ckpt = await s.call("graph_kv_checkpoint", action="list")
            assert [c["id"] for c in listed_ckpt["checkpoints"]] == [cid]
            restored = await s.call(
                "graph_kv_checkpoint",
                action="restore",
                checkpoint_id=cid,
                conversation_id="conv-1",
                include_blob=True,
            )
            assert restored["cold_start"] is False
            assert restored["blob_base64"] == blob
            stale = await s.call(
                "graph_kv_checkpoint", action="restore", checkpoint_id=cid, policy_version="2"
            )
            assert "StaleCheckpointError" in stale["error"]
            cold = await s.call(
                "graph_kv_checkpoint",
                action="restore",
                checkpoint_id=cid,
                policy_version="2",
                allow_cold_start=True,
            )
            assert cold["cold_start"] is True

            deleted = await s.call("graph_kvcache", action="delete", key="other")
            assert deleted == {"key": "other", "deleted": True}
            assert (await s.call("graph_kvcache", action="delete", key="model@b-secret"))[
                "deleted"
            ] is False
            return s.transcript

    transcript = asyncio.run(scenario())
    out = os.environ.get("KVCACHE_MCP_TRANSCRIPT")
    if out:
        Path(out).write_text(json.dumps(transcript, indent=1) + "\n")
    # Tenant B's key is untouched by everything tenant A's token did.
    with EpistemicGraphKVBackend(KvCacheConfig(base_url=url, token=TOKEN_B)) as b:
        assert b.get("model@b-secret") == b"b" * 10


def test_stdio_without_a_token_refuses_to_start(kv: ServerHandle, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "mcp"],
        env=_env(kv.http_url, None),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 2
    assert "epistemic-kvcache mcp: error: missing EPISTEMIC_GRAPH_KVCACHE_TOKEN" in proc.stderr


def _free_port() -> int:
    return held_port()  # held for the rest of the run: never a released port


@pytest.fixture
def mcp_http(kv: ServerHandle, tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "epistemic_kvcache", "mcp", "--transport", "http"]
    with (tmp_path / "mcp.log").open("wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--listen", f"127.0.0.1:{port}"],
            env=_env(kv.http_url, TOKEN_A),  # a token in its environment must not be used
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None, (tmp_path / "mcp.log").read_text()
        time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _http_call(url: str, token: str | None, tool: str, **args: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http), read_timeout_seconds=60) as c,
    ):
        return _result(await c.call_tool(tool, args))


def test_http_uses_each_callers_token(kv: ServerHandle, mcp_http: str) -> None:
    _seed(kv.http_url, TOKEN_A, {"http-a": b"1"})
    _seed(kv.http_url, TOKEN_B, {"http-b": b"2"})

    async def scenario() -> None:
        a = await _http_call(mcp_http, TOKEN_A, "graph_kvcache", action="list", prefix="http-")
        b = await _http_call(mcp_http, TOKEN_B, "graph_kvcache", action="list", prefix="http-")
        assert a["keys"] == ["http-a"]
        assert b["keys"] == ["http-b"]
        st = await _http_call(mcp_http, TOKEN_B, "graph_kvcache", action="stats")
        assert st["namespace"] == "tenant-b"
        gone = await _http_call(mcp_http, TOKEN_B, "graph_kvcache", action="delete", key="http-a")
        assert gone["deleted"] is False

    asyncio.run(scenario())
    with EpistemicGraphKVBackend(KvCacheConfig(base_url=kv.http_url, token=TOKEN_A)) as a:
        assert a.get("http-a") == b"1"


@pytest.mark.parametrize("token", [None, "not-a-token-the-server-knows-0123456789"])
def test_http_refuses_callers_without_a_valid_token(mcp_http: str, token: str | None) -> None:
    import httpx

    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    r = httpx.post(mcp_http, json=body, headers=headers, timeout=30)
    assert r.status_code == 401
