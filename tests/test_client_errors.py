"""The client's error handling: the one error table (proto/errors.py) drives what each
HTTP error does, and a connection reset is retried only for requests safe to repeat.
The reset tests run a real server behind a proxy that forwards a request, lets the
server answer, and then resets the client's connection instead of passing the answer on
(the request was applied; the client cannot know)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from epistemic_kvcache.client import (
    RETRY_ON_RESET,
    EpistemicGraphKVBackend,
    KvCacheConfig,
    KvCacheOutcomeUnknownError,
    PutOutcome,
)
from epistemic_kvcache.errors import (
    AuthError,
    BlockTooLargeError,
    ClusterUnavailableError,
    ForbiddenError,
    InvalidKeyError,
    KvCacheError,
    LocalProtocolError,
    OutcomeUnknownError,
    StorageIOError,
)
from epistemic_kvcache.proto.errors import (
    ERROR_ROWS,
    HTTP_ONLY_ROWS,
    client_rule,
    exception_for_code,
    resp_text,
    row_for,
)
from servers import TOKEN, ServeProcess

# -- the table -----------------------------------------------------------------------------


def test_cluster_unavailable_has_its_own_row_saying_the_outcome_is_unknown() -> None:
    """Before: it matched the StorageIOError row, "storage I/O error, nothing was stored",
    though the cluster may have applied the write."""
    exc = ClusterUnavailableError("cluster down at 10.0.0.7:7000")
    row = row_for(exc)
    assert row.exc is ClusterUnavailableError
    assert (row.status, row.code, row.applied, row.client) == (
        503,
        "outcome_unknown",
        "unknown",
        "unknown",
    )
    assert "nothing was stored" not in resp_text(row, exc)
    assert "may or may not have been applied" in resp_text(row, exc)
    assert "10.0.0.7" not in resp_text(row, exc)  # private: the address stays in the log
    assert exception_for_code("outcome_unknown") is ClusterUnavailableError
    assert isinstance(exc, OutcomeUnknownError)
    assert isinstance(exc, StorageIOError)  # still caught where it was caught before
    assert row_for(StorageIOError("EIO")).applied == "no"


@pytest.mark.parametrize(
    ("status", "code", "action", "exc", "applied"),
    [
        (400, "bad_key", "raise", InvalidKeyError, "no"),
        (400, "bad_request", "raise", KvCacheError, "n/a"),  # a protocol error: raised
        (401, "unauthorized", "raise", AuthError, "n/a"),
        (403, "forbidden", "raise", ForbiddenError, "n/a"),
        (413, "block_too_large", "refused", BlockTooLargeError, "no"),
        (413, "batch_too_large", "split", LocalProtocolError, "no"),
        (411, "length_required", "refused", LocalProtocolError, "no"),
        (507, "quota_exceeded", "refused", KvCacheError, "no"),
        (507, "insufficient_storage", "refused", KvCacheError, "no"),
        (503, "storage_io_error", "degrade", StorageIOError, "no"),
        (503, "outcome_unknown", "unknown", ClusterUnavailableError, "unknown"),
        (503, "overloaded", "degrade", KvCacheError, "no"),
        (429, "tenant_busy", "degrade", KvCacheError, "no"),
        (408, "request_timeout", "degrade", KvCacheError, "no"),
        # no code (a proxy, an older server): by status, else by status class
        (507, None, "refused", KvCacheError, "no"),
        (429, None, "degrade", KvCacheError, "no"),
        (502, None, "degrade", KvCacheError, "unknown"),
        (503, None, "degrade", KvCacheError, "unknown"),
        (418, None, "raise", LocalProtocolError, "n/a"),
    ],
)
def test_client_rule_table(
    status: int, code: str | None, action: str, exc: type[Exception], applied: str
) -> None:
    rule = client_rule(status, code)
    assert rule.action == action
    assert issubclass(rule.exc, exc)
    assert rule.applied == applied


def test_every_code_the_server_sends_has_a_client_rule() -> None:
    for row in ERROR_ROWS:
        assert client_rule(row.status, row.code).exc is exception_for_code(row.code)
    for only in HTTP_ONLY_ROWS:
        assert client_rule(only.status, only.code).action == only.client


def test_batch_put_words_map_through_the_table() -> None:
    assert PutOutcome.from_word("error:outcome_unknown") is PutOutcome.UNKNOWN
    assert PutOutcome.from_word("error:storage_io_error") is PutOutcome.FAILED
    assert PutOutcome.from_word("error:block_too_large") is PutOutcome.FAILED
    assert PutOutcome.from_word("error:something_new") is PutOutcome.FAILED
    assert not PutOutcome.UNKNOWN


def test_retry_table_repeats_only_what_is_safe_to_repeat() -> None:
    for safe in ("GET", "HEAD", "batch get", "batch exists", "PUT", "batch put", "epoch"):
        assert RETRY_ON_RESET[safe] is True
    for unsafe in (
        "snapshot",
        "fork",
        "epoch bump",
        "DELETE",
        "conditional PUT",
        "epoch-tagged PUT",
        "branch PUT",
        "snapshot delete",
        "branch delete",
    ):
        assert RETRY_ON_RESET[unsafe] is False


# -- resets through a real server ----------------------------------------------------------


def _read_message(sock: socket.socket, buf: bytearray, *, head_only: bool = False) -> bytes:
    """One HTTP message (head + Content-Length body) from `sock`; b"" at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if head_only:
        length = 0
    while len(buf) < end + length:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        buf += chunk
    message = bytes(buf[: end + length])
    del buf[: end + length]
    return message


class ResettingProxy:
    """Forwards HTTP requests to `upstream`; for the first request whose request line
    satisfies `cut`, it forwards it, waits for the server's whole answer, then resets the
    client's connection (RST) instead of passing the answer on."""

    def __init__(self, upstream: int, cut: Callable[[bytes], bool]) -> None:
        self.upstream = upstream
        self.cut = cut
        self.cuts_left = 1
        self.seen: list[bytes] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(client,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, client: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.upstream), timeout=30)
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while True:
                request = _read_message(client, cbuf)
                if not request:
                    return
                line = request.split(b"\r\n", 1)[0]
                with self.lock:
                    self.seen.append(line)
                    cut = self.cuts_left > 0 and self.cut(line)
                    if cut:
                        self.cuts_left -= 1
                up.sendall(request)
                answer = _read_message(up, ubuf, head_only=line.startswith(b"HEAD "))
                if cut or not answer:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return  # closing with linger 0 sends RST
                client.sendall(answer)
        except OSError:
            return
        finally:
            client.close()
            up.close()

    def count(self, prefix: bytes) -> int:
        with self.lock:
            return sum(1 for line in self.seen if line.startswith(prefix))

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


def _client(port: int) -> EpistemicGraphKVBackend:
    return EpistemicGraphKVBackend(
        KvCacheConfig(base_url=f"http://127.0.0.1:{port}", token=TOKEN, breaker_max_backoff_s=0)
    )


@pytest.fixture
def direct(server: ServeProcess) -> Iterator[EpistemicGraphKVBackend]:
    with _client(server.http_port) as c:
        yield c


def test_reset_after_a_snapshot_is_not_retried(
    server: ServeProcess, direct: EpistemicGraphKVBackend
):
    """Before: the client sent the snapshot again and the server held two snapshots."""
    assert direct.put("snap-k", b"v")
    before = len(direct.list_snapshots())
    proxy = ResettingProxy(server.http_port, lambda line: line.startswith(b"POST /kv/snapshot "))
    try:
        with _client(proxy.port) as c, pytest.raises(KvCacheOutcomeUnknownError):
            c.snapshot(keys=["snap-k"])
    finally:
        proxy.close()
    assert proxy.count(b"POST /kv/snapshot ") == 1
    assert len(direct.list_snapshots()) == before + 1  # it was applied, once


def test_reset_after_an_epoch_bump_is_not_retried(
    server: ServeProcess, direct: EpistemicGraphKVBackend
):
    start = direct.epoch_get("scope-r")
    proxy = ResettingProxy(server.http_port, lambda line: b"/bump " in line)
    try:
        with _client(proxy.port) as c, pytest.raises(KvCacheOutcomeUnknownError):
            c.epoch_bump("scope-r")
    finally:
        proxy.close()
    assert proxy.count(b"POST /kv/epoch/") == 1
    assert direct.epoch_get("scope-r") == start + 1  # one bump, not two


def test_reset_after_a_fork_is_not_retried(server: ServeProcess, direct: EpistemicGraphKVBackend):
    assert direct.put("fork-k", b"v")
    snap = direct.snapshot(keys=["fork-k"])
    assert snap is not None
    before = len(direct.list_branches())
    proxy = ResettingProxy(server.http_port, lambda line: b"/fork " in line)
    try:
        with _client(proxy.port) as c, pytest.raises(KvCacheOutcomeUnknownError):
            c.fork(snap.id)
    finally:
        proxy.close()
    assert proxy.count(b"POST /kv/snapshot/") == 1
    assert len(direct.list_branches()) == before + 1


def test_reset_after_a_conditional_put_is_not_retried(
    server: ServeProcess, direct: EpistemicGraphKVBackend
) -> None:
    proxy = ResettingProxy(server.http_port, lambda line: line.startswith(b"PUT "))
    try:
        with _client(proxy.port) as c:
            assert c.put("nx-k", b"v", cond="nx") is PutOutcome.UNKNOWN
    finally:
        proxy.close()
    assert proxy.count(b"PUT ") == 1
    assert direct.get("nx-k") == b"v"  # it was applied


def test_reset_on_a_get_is_retried(server: ServeProcess, direct: EpistemicGraphKVBackend) -> None:
    assert direct.put("get-k", b"value")
    proxy = ResettingProxy(server.http_port, lambda line: line.startswith(b"GET /kv/get-k "))
    try:
        with _client(proxy.port) as c:
            assert c.get("get-k") == b"value"
    finally:
        proxy.close()
    assert proxy.count(b"GET /kv/get-k ") == 2


def test_reset_on_a_plain_put_is_retried(
    server: ServeProcess, direct: EpistemicGraphKVBackend
) -> None:
    proxy = ResettingProxy(server.http_port, lambda line: line.startswith(b"PUT "))
    try:
        with _client(proxy.port) as c:
            assert c.put("put-k", b"same bytes") is PutOutcome.DUPLICATE  # the retry's answer
    finally:
        proxy.close()
    assert proxy.count(b"PUT ") == 2
    assert direct.get("put-k") == b"same bytes"
