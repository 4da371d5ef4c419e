"""Sans-IO pieces of the HTTP API: routes, key segments, batch framing, response heads."""

from __future__ import annotations

import ast
import contextlib
import http.client
import io
import json
import struct
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto.errors import ERROR_ROWS
from epistemic_kvcache.proto.http import (
    ROUTE_BATCH_EXISTS,
    ROUTE_BATCH_GET,
    ROUTE_BATCH_PUT,
    ROUTE_HEALTHZ,
    ROUTE_KEY,
    ROUTE_KEY_EXISTS,
    ROUTE_METRICS,
    ROUTE_STATS,
    BatchPutReceiver,
    decode_batch_get_response,
    decode_batch_put_request,
    decode_key_list,
    decode_key_segment,
    encode_batch_get_response,
    encode_batch_put_request,
    error_body,
    match_route,
    quote_key,
    request_path,
    response_head,
    status_line,
)

keys = st.text(min_size=1, max_size=200).filter(lambda k: 0 < len(k.encode("utf-8")) <= 1024)


@pytest.mark.parametrize(
    ("path", "route", "segment"),
    [
        (b"/healthz", ROUTE_HEALTHZ, None),
        (b"/metrics", ROUTE_METRICS, None),
        (b"/kv/stats", ROUTE_STATS, None),
        (b"/kv/batch/exists", ROUTE_BATCH_EXISTS, None),
        (b"/kv/batch/get", ROUTE_BATCH_GET, None),
        (b"/kv/batch/put", ROUTE_BATCH_PUT, None),
        (b"/kv/abc", ROUTE_KEY, b"abc"),
        (b"/kv/a%2Fb%40c", ROUTE_KEY, b"a%2Fb%40c"),
        (b"/kv/a%2Fb/exists", ROUTE_KEY_EXISTS, b"a%2Fb"),
        (b"/kv/%73tats", ROUTE_KEY, b"%73tats"),
        (b"/kv/exists", ROUTE_KEY, b"exists"),
        (b"/kv/", ROUTE_KEY, b""),
        (b"/kv/batch", None, None),
        (b"/kv/stats/exists", None, None),
        (b"/kv/a/b", None, None),
        (b"/kv/a/b/exists", None, None),
        (b"/kv", None, None),
        (b"/", None, None),
        (b"/healthz/", None, None),
    ],
)
def test_match_route(path: bytes, route: str | None, segment: bytes | None) -> None:
    assert match_route(path) == (route, segment)


@pytest.mark.parametrize(
    ("target", "path"),
    [
        (b"/kv/a?x=1", b"/kv/a"),
        (b"/kv/a#frag", b"/kv/a"),
        (b"/kv/a%3Fb", b"/kv/a%3Fb"),
        (b"http://host:9130/kv/a?x", b"/kv/a"),
        (b"https://host", b"/"),
        (b"*", b"*"),
    ],
)
def test_request_path(target: bytes, path: bytes) -> None:
    assert request_path(target) == path


@given(keys)
def test_quote_key_round_trips_as_one_segment(key: str) -> None:
    quoted = quote_key(key)
    assert "/" not in quoted
    route, segment = match_route(b"/kv/" + quoted.encode("ascii"))
    assert route == ROUTE_KEY
    assert segment is not None
    assert decode_key_segment(segment) == key
    route, segment = match_route(b"/kv/" + quoted.encode("ascii") + b"/exists")
    assert route == ROUTE_KEY_EXISTS
    assert segment is not None
    assert decode_key_segment(segment) == key


def test_reserved_keys_stay_reachable() -> None:
    for key in ("stats", "batch"):
        quoted = quote_key(key).encode()
        assert match_route(b"/kv/" + quoted) == (ROUTE_KEY, quoted)
        assert decode_key_segment(quoted) == key


@pytest.mark.parametrize(
    ("segment", "why"),
    [
        (b"", "empty"),
        (b"%", None),  # a lone % is kept literally: valid one-byte key
        (b"%FF", "UTF-8"),
        (b"%C3", "UTF-8"),
        (b"a" * 1025, "1025 bytes"),
        (b"%41" * 1025, "1025 bytes"),
    ],
)
def test_decode_key_segment_errors(segment: bytes, why: str | None) -> None:
    if why is None:
        assert decode_key_segment(segment) == "%"
        return
    with pytest.raises(RemoteProtocolError, match=why) as info:
        decode_key_segment(segment)
    assert info.value.status_hint == 400


def test_key_of_exactly_1024_bytes() -> None:
    assert decode_key_segment(quote_key("é" * 512).encode()) == "é" * 512


# -- batch framing ----------------------------------------------------------------------------


@given(st.lists(st.one_of(st.none(), st.binary(max_size=300)), max_size=20))
def test_batch_get_round_trip(blocks: list[bytes | None]) -> None:
    body = b"".join(bytes(p) for p in encode_batch_get_response(blocks))
    decoded = decode_batch_get_response(body)
    assert [None if d is None else bytes(d) for d in decoded] == blocks


@given(st.lists(st.tuples(keys, st.binary(max_size=300)), max_size=20))
def test_batch_put_round_trip(items: list[tuple[str, bytes]]) -> None:
    parts = encode_batch_put_request([k for k, _ in items], [v for _, v in items])
    assert [bytes(p) for p in parts[1:]] == [v for _, v in items]  # blocks are not copied
    body = b"".join(bytes(p) for p in parts)
    decoded = decode_batch_put_request(body, max_keys=100)
    assert [(k, bytes(v)) for k, v in decoded] == items


def test_batch_blocks_are_views_into_the_body() -> None:
    body = bytearray(b"".join(bytes(p) for p in encode_batch_put_request(["a"], [b"xyz"])))
    ((_, view),) = decode_batch_put_request(body, max_keys=1)
    body[-1:] = b"!"
    assert bytes(view) == b"xy!"


def frame(header: object, payload: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + payload


@pytest.mark.parametrize(
    ("body", "match", "status"),
    [
        (b"", "shorter", 400),
        (b"\x00\x00\x00", "shorter", 400),
        (b"\x00\x00\x00\x10{}", "truncated", 400),
        (b"\x00\x00\x00\x02[]", "not an object", 400),
        (b"\x00\x00\x00\x03{x}", "invalid JSON", 400),
        (b"\x00\x00\x00\x02\xff\xfe", "invalid JSON", 400),
        (b"\x7f\xff\xff\xff{}", "exceeds", 413),
        (frame({"keys": "a", "sizes": [1]}, b"x"), "list of strings", 400),
        (frame({"keys": [1], "sizes": [1]}, b"x"), "list of strings", 400),
        (frame({"keys": ["a"]}, b"x"), "'sizes' must be a list", 400),
        (frame({"keys": ["a"], "sizes": [-1]}, b""), "invalid size", 400),
        (frame({"keys": ["a"], "sizes": [1.5]}, b"x"), "invalid size", 400),
        (frame({"keys": ["a"], "sizes": [True]}, b"x"), "invalid size", 400),
        (frame({"keys": ["a", "b"], "sizes": [1]}, b"x"), "2 keys but 1 sizes", 400),
        (frame({"keys": ["a"], "sizes": [2]}, b"x"), "add up to 2 bytes but 1", 400),
        (frame({"keys": ["a"], "sizes": [1]}, b"xy"), "add up to 1 bytes but 2", 400),
        (frame({"keys": ["a"] * 5, "sizes": [0] * 5}), "max_batch_keys", 413),
    ],
)
def test_batch_put_malformed(body: bytes, match: str, status: int) -> None:
    with pytest.raises(RemoteProtocolError, match=match) as info:
        decode_batch_put_request(body, max_keys=4, max_header_bytes=1 << 20)
    assert info.value.status_hint == status


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "keys": json_values | st.lists(st.text(max_size=4), max_size=4),
        "sizes": json_values | st.lists(st.integers(-2, 8), max_size=4),
    },
)


@settings(max_examples=300)
@given(st.binary(max_size=200) | st.builds(frame, headers, st.binary(max_size=20)))
def test_batch_decoders_fuzz(body: bytes) -> None:
    """Any input decodes or raises RemoteProtocolError, nothing else."""
    for decode in (
        lambda b: decode_batch_put_request(b, max_keys=8),
        decode_batch_get_response,
        lambda b: decode_key_list(b, max_keys=8),
        lambda b: decode_key_list(b[4:], max_keys=8),
    ):
        with contextlib.suppress(RemoteProtocolError):
            decode(body)


def _receive(body: bytes, chunks: list[int], *, inplace: bool) -> list[tuple[str, bytes]]:
    """`body` through a `BatchPutReceiver`, in reads of the given sizes (cycled): into
    its `buffer()` as a socket would, or handed over with `feed` (bytes read with a head)."""
    allocated: list[memoryview] = []

    def alloc(n: int) -> memoryview:
        allocated.append(memoryview(bytearray(n)))
        return allocated[-1]

    rx = BatchPutReceiver(len(body), max_keys=8, alloc=alloc, max_header_bytes=1 << 20)
    pos, i = 0, 0
    while pos < len(body):
        want = chunks[i % len(chunks)]
        i += 1
        if inplace:
            target = rx.buffer()
            assert len(target) > 0
            n = min(len(target), want, len(body) - pos)
            target[:n] = body[pos : pos + n]
            rx.advance(n)
        else:
            n = min(want, len(body) - pos)
            rx.feed(body[pos : pos + n])
        pos += n
    assert rx.done
    assert len(rx.buffer()) == 0  # never a byte past the body (the next request's)
    items = rx.items()
    # every block is one of the buffers from `alloc`, whole (the store keeps it as is)
    owners = [b.obj for b in allocated]
    for _, block in items:
        assert len(block) == 0 or any(memoryview(block).obj is o for o in owners)
    return [(k, bytes(v)) for k, v in items]


@settings(max_examples=300)
@given(
    st.binary(max_size=200)
    | st.builds(frame, headers, st.binary(max_size=20))
    | st.lists(st.tuples(keys, st.binary(max_size=40)), max_size=6).map(
        lambda items: b"".join(
            bytes(p) for p in encode_batch_put_request([k for k, _ in items], [v for _, v in items])
        )
    ),
    st.lists(st.integers(1, 64), min_size=1, max_size=5),
    st.booleans(),
)
def test_batch_put_receiver_matches_the_decoder(
    body: bytes, chunks: list[int], inplace: bool
) -> None:
    """Received in pieces, a body gives what `decode_batch_put_request` gives, or the same
    error (message and status)."""

    def outcome(decode: Callable[[], list[tuple[str, bytes]]]) -> object:
        try:
            return decode()
        except RemoteProtocolError as exc:
            return (str(exc), exc.status_hint)

    expected = outcome(
        lambda: [
            (k, bytes(v))
            for k, v in decode_batch_put_request(body, max_keys=8, max_header_bytes=1 << 20)
        ]
    )
    assert outcome(lambda: _receive(body, chunks, inplace=inplace)) == expected


def test_batch_put_receiver_reads_blocks_in_place() -> None:
    blocks = [b"a" * 1000, b"", b"b" * 3000]
    body = b"".join(bytes(p) for p in encode_batch_put_request(["x", "y", "z"], blocks))
    made: list[memoryview] = []

    def alloc(n: int) -> memoryview:
        made.append(memoryview(bytearray(n)))
        return made[-1]

    rx = BatchPutReceiver(len(body), max_keys=8, alloc=alloc)
    head = len(body) - 4000
    rx.feed(body[: head + 10])  # the head and 10 block bytes came with the request head
    target = rx.buffer()
    assert target.obj is made[0].obj  # the first block's own buffer, 10 bytes in
    assert len(target) == 990
    target[:] = body[head + 10 : head + 1000]
    rx.advance(990)
    target = rx.buffer()
    assert target.obj is made[1].obj  # the empty block takes nothing
    assert len(target) == 3000
    target[:] = body[head + 1000 :]
    rx.advance(3000)
    assert rx.done
    assert [(k, bytes(v)) for k, v in rx.items()] == [
        ("x", blocks[0]),
        ("y", b""),
        ("z", blocks[2]),
    ]


def test_batch_put_receiver_reads_past_a_bad_header() -> None:
    body = frame({"keys": ["a"], "sizes": [5]}, b"12345") + b""
    bad = body.replace(b'"sizes"', b'"sizez"')
    rx = BatchPutReceiver(len(bad), max_keys=8, alloc=lambda n: memoryview(bytearray(n)))
    rx.feed(bad[:-2])
    assert not rx.done
    rx.feed(bad[-2:])  # read and dropped: the connection stays in step
    assert rx.done
    with pytest.raises(RemoteProtocolError, match="'sizes' must be a list"):
        rx.items()


def test_decode_key_list() -> None:
    assert decode_key_list(b'{"keys": ["a", "b/c"]}', max_keys=2) == ["a", "b/c"]
    for bad in (b"", b"[]", b'{"keys": {}}', b'{"keys": [null]}', b"\xff"):
        with pytest.raises(RemoteProtocolError):
            decode_key_list(bad, max_keys=2)
    with pytest.raises(RemoteProtocolError, match="max_batch_keys") as info:
        decode_key_list(b'{"keys": ["a", "b", "c"]}', max_keys=2)
    assert info.value.status_hint == 413


def test_encode_batch_put_checks_lengths() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 blocks"):
        encode_batch_put_request(["a", "b"], [b"x"])


# -- responses --------------------------------------------------------------------------------


def parse_response(raw: bytes) -> tuple[int, dict[bytes, bytes]]:
    headers: dict[bytes, bytes] = {}

    class P:
        def on_header(self, name: bytes, value: bytes) -> None:
            headers[name.lower()] = value

    parser = httptools.HttpResponseParser(P())
    parser.feed_data(raw)
    return parser.get_status_code(), headers


def test_response_head_parses() -> None:
    head = response_head(201, [("X-Kv-Outcome", "created")], content_length=5, close=True)
    assert head.startswith(b"HTTP/1.1 201 Created\r\n")
    assert head.endswith(b"\r\n\r\n")
    status, headers = parse_response(head + b"hello")
    assert status == 201
    assert headers[b"content-length"] == b"5"
    assert headers[b"connection"] == b"close"
    assert headers[b"x-kv-outcome"] == b"created"
    assert headers[b"date"].endswith(b" GMT")


def test_response_head_variants() -> None:
    head = response_head(204, [], content_length=None)
    assert b"Content-Length" not in head
    assert b"Connection" not in head
    head = response_head(200, [], content_length=0, keep_alive_header=True)
    assert b"Connection: keep-alive\r\n" in head
    with pytest.raises(ValueError, match="line break"):
        response_head(200, [("X", "a\r\nInjected: yes")], content_length=0)


def _statuses_in_source() -> set[int]:
    """Every HTTP status the server's code can answer with, read from the source: the
    first argument of the calls that make answers (`HttpError`, `Response.*`), every
    `status=`/`status_hint=` keyword, what functions named `*status*` return, every
    row of the error table, and 100 Continue."""
    root = Path(__file__).resolve().parent.parent / "src" / "epistemic_kvcache"
    makers = {"HttpError", "Response", "error", "json", "encoded_json", "empty", "large_json"}
    found = {100} | {row.status for row in ERROR_ROWS}

    def codes(node: ast.AST) -> set[int]:
        return {
            n.value
            for n in ast.walk(node)
            if isinstance(n, ast.Constant) and type(n.value) is int and 100 <= n.value <= 599
        }

    for path in [*root.glob("server/**/*.py"), *root.glob("proto/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                if name in makers and node.args:
                    found |= codes(node.args[0])
                for kw in node.keywords:
                    if kw.arg in ("status", "status_hint"):
                        found |= codes(kw.value)
            elif isinstance(node, ast.FunctionDef) and "status" in node.name:
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        found |= codes(ret.value)
    return found


def test_every_status_the_server_sends_has_its_standard_reason() -> None:
    """Issue 22: a hand-written reason table lacked 409 and 412 (`HTTP/1.1 412 Unknown`).
    Every status the server can send gets `http.HTTPStatus`'s phrase, and the standard
    library's client reads it back."""
    statuses = _statuses_in_source()
    # the scan sees what it must (a scan that finds nothing would pass vacuously)
    assert {100, 200, 201, 204, 404, 409, 412, 413, 429, 431, 503, 507} <= statuses
    for status in sorted(statuses):
        phrase = HTTPStatus(status).phrase  # ValueError: a status the stdlib does not know
        head = response_head(status, [], content_length=0)
        assert head.startswith(f"HTTP/1.1 {status} {phrase}\r\n".encode()), head
        assert b"Unknown" not in head
        if status >= 200:
            resp = http.client.HTTPResponse(_FakeSocket(head))  # type: ignore[arg-type]
            resp.begin()
            assert (resp.status, resp.reason) == (status, phrase)


def test_status_line_of_a_code_the_stdlib_does_not_know() -> None:
    assert status_line(599) == b"HTTP/1.1 599 \r\n"  # empty reason: RFC 9112 section 4
    assert parse_response(response_head(599, [], content_length=0))[0] == 599
    for bad in (99, 1000, -200):
        with pytest.raises(ValueError, match="invalid HTTP status"):
            status_line(bad)


class _FakeSocket:
    """What `http.client.HTTPResponse` reads a response from."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(io.BytesIO(self._data))


def test_error_body() -> None:
    assert json.loads(error_body("bad_key", "invalid key: empty")) == {
        "error": "bad_key",
        "message": "invalid key: empty",
    }
