"""A small OpenAI-compatible stand-in for vLLM's automatic prefix cache (a test oracle).

vLLM cannot run on machines without a GPU, so this server stands in for it when
measuring whether rendered bundles reuse the engine's prefix cache. It is *not* a
model: it answers with a fixed sentence. What it does for real is the part that matters
here, the way vLLM does it:

- the chat messages are rendered through a fixed chat template and split into tokens
  (whitespace-delimited words, each with its leading whitespace);
- tokens are grouped into blocks of `block_tokens` (16, vLLM's default block size);
  block i's hash chains block i-1's hash with block i's tokens, so a block can only hit
  when the whole prefix before it is identical;
- a request hits the longest run of leading full blocks already cached (never the whole
  prompt: the last token is always computed, like vLLM), then inserts its full blocks
  into a bounded LRU;
- `/metrics` exposes `vllm:prefix_cache_queries_total` (prompt tokens looked up) and
  `vllm:prefix_cache_hits_total` (tokens served from the cache), vLLM's counter names;
- "prefill" sleeps `prefill_us_per_token` per uncached token, so cold vs warm latency
  differs the way it does on a GPU, just scaled down.

It also records each request's `kv_transfer_params`, so tests can check what a client
asked LMCache to do. Run it with
`python tests/prefix_cache_standin.py --port 0`. It lives under tests/, not in the
package: nothing in src/ uses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"\s*\S+")
MAX_BODY_BYTES = 8 * 1024 * 1024
"""Prompts of a few hundred thousand tokens fit; bigger bodies are refused (413)."""


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """A fixed chat template: `<|role|>` header, content, newline; then the assistant tag."""
    parts = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def tokenize(text: str) -> list[str]:
    """Whitespace-delimited tokens (each keeps its leading whitespace)."""
    return _TOKEN.findall(text)


class BlockPrefixCache:
    """Hash-chained token-block prefix cache with LRU eviction (thread-safe)."""

    def __init__(self, *, block_tokens: int = 16, max_blocks: int = 65_536) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("block_tokens and max_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self.queries_total = 0
        self.hits_total = 0

    def _hashes(self, tokens: Sequence[str]) -> list[bytes]:
        out = []
        prev = b""
        bt = self.block_tokens
        for start in range(0, len(tokens) - bt + 1, bt):
            h = hashlib.sha256(prev)
            h.update("\x00".join(tokens[start : start + bt]).encode("utf-8"))
            prev = h.digest()
            out.append(prev)
        return out

    def lookup_and_insert(self, tokens: Sequence[str]) -> int:
        """Count hit tokens for this prompt, then cache its full blocks. Returns hits."""
        hashes = self._hashes(tokens)
        with self._lock:
            hit_blocks = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                hit_blocks += 1
            if hit_blocks * self.block_tokens >= len(tokens):
                hit_blocks = max(0, hit_blocks - 1)  # the last token is always computed
            for h in hashes:
                self._blocks[h] = None
                self._blocks.move_to_end(h)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
            hits = hit_blocks * self.block_tokens
            self.queries_total += len(tokens)
            self.hits_total += hits
            return hits

    def reset(self) -> None:
        """Forget every block (counters keep running, like a vLLM cache reset)."""
        with self._lock:
            self._blocks.clear()


class _Handler(BaseHTTPRequestHandler):
    server: _StandinHTTPServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("standin: " + format, *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        doc = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        self._send(status, json.dumps(doc).encode())

    def do_GET(self) -> None:
        owner = self.server.owner
        if self.path == "/metrics":
            self._send(200, owner.metrics_text().encode(), "text/plain; version=0.0.4")
        elif self.path in ("/health", "/healthz"):
            self._send(200, b"{}")
        elif self.path == "/v1/models":
            doc = {"object": "list", "data": [{"id": owner.model, "object": "model"}]}
            self._send(200, json.dumps(doc).encode())
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self._error(404, f"no route {self.path}")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._error(411, "Content-Length required")
            self.close_connection = True
            return
        if int(length) > MAX_BODY_BYTES:
            self._error(413, "request body too large")
            self.close_connection = True
            return
        try:
            doc = json.loads(self.rfile.read(int(length)))
            messages = doc["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise TypeError("messages must be a list of objects")
        except (ValueError, KeyError, TypeError) as exc:
            self._error(400, f"bad request: {exc}")
            return
        self._send(200, json.dumps(self.server.owner.complete(doc)).encode())


class _StandinHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: PrefixCacheStandin


class PrefixCacheStandin:
    """The stand-in server. `start()` binds (port 0 = any free port) and serves on a
    daemon thread; `close()` stops it. Usable as a context manager."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "standin",
        block_tokens: int = 16,
        max_blocks: int = 65_536,
        prefill_us_per_token: float = 50.0,
        history: int = 1024,
    ) -> None:
        self.model = model
        self.cache = BlockPrefixCache(block_tokens=block_tokens, max_blocks=max_blocks)
        self.prefill_us_per_token = prefill_us_per_token
        self.requests: deque[dict[str, Any]] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._counter = 0
        self._httpd = _StandinHTTPServer((host, port), _Handler)
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """`(host, port)` actually bound."""
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """`http://host:port` (metrics live at `url + "/metrics"`)."""
        host, port = self.address
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL (`url + "/v1"`)."""
        return self.url + "/v1"

    def start(self) -> PrefixCacheStandin:
        """Serve on a background thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="prefix-cache-standin",
            daemon=True,
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread until `close()` from another thread (or Ctrl-C)."""
        self._httpd.serve_forever()

    def close(self) -> None:
        """Stop serving and release the socket."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> PrefixCacheStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Run one chat completion request (prefix lookup, simulated prefill, reply)."""
        tokens = tokenize(render_chat(doc["messages"]))
        hits = self.cache.lookup_and_insert(tokens)
        time.sleep((len(tokens) - hits) * self.prefill_us_per_token / 1e6)
        reply = f"stand-in reply: {len(tokens)} prompt tokens, {hits} from the prefix cache."
        completion_tokens = len(tokenize(reply))
        with self._lock:
            self._counter += 1
            rid = self._counter
            self.requests.append(
                {
                    "prompt_tokens": len(tokens),
                    "hit_tokens": hits,
                    "kv_transfer_params": doc.get("kv_transfer_params"),
                }
            )
        return {
            "id": f"chatcmpl-standin-{rid}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(doc.get("model", self.model)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": completion_tokens,
                "total_tokens": len(tokens) + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": hits},
            },
        }

    def metrics_text(self) -> str:
        """Prometheus text with vLLM's prefix-cache counters."""
        labels = f'{{engine="0",model_name="{self.model}"}}'
        c = self.cache
        return (
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of tokens.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{labels} {float(c.queries_total)}\n"
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of tokens.\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{labels} {float(c.hits_total)}\n"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: serve until interrupted; prints `listening http=HOST:PORT`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="standin")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--prefill-us-per-token", type=float, default=50.0)
    args = ap.parse_args(argv)
    server = PrefixCacheStandin(
        host=args.host,
        port=args.port,
        model=args.model,
        block_tokens=args.block_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
    )
    host, port = server.address
    print(f"listening http={host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
