"""Redis' rules the RESP framer applies: default limits, strict integers, error wording.

How it works: what the framer (proto/resp_parser.py) needs off its fast path lives
here, in plain Python, so that its compiled twin holds only the framing itself. The
defaults of every limit `RespParser` takes are Redis' own, each with where it comes
from. A `*N` / `$N` header that is not in canonical form goes the careful way and is
read as Redis' `string2ll` reads it (`parse_int`: a strict signed 64-bit decimal, no
sign but `-`, no leading zero). A violation is raised as `RemoteProtocolError` in
Redis' words (`protocol_error`: "Protocol error: ...", a bad byte shown as Redis shows
it, `show_byte`), so clients that match on those messages see the same ones.
"""

from __future__ import annotations

import re
from typing import Final

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto.resp_types import MAX_LIMIT, Buffer

KiB: Final = 1024
MiB: Final = 1024 * 1024

DEFAULT_MAX_INLINE_BYTES: Final = 64 * KiB
"""Longest inline request, and longest `*N` / `$N` header line (Redis PROTO_INLINE_MAX_SIZE)."""
DEFAULT_MAX_MULTIBULK_LEN: Final = 1024 * 1024
"""Most arguments in one command (Redis' historic multibulk limit, 1024*1024)."""
DEFAULT_MAX_BULK_BYTES: Final = 512 * MiB
"""Longest bulk argument (Redis `proto-max-bulk-len` default, 512 MiB)."""
DEFAULT_UNAUTHENTICATED_MAX_MULTIBULK_LEN: Final = 10
"""Before AUTH: Redis refuses more than 10 arguments (CVE-2021-32675 fix)."""
DEFAULT_UNAUTHENTICATED_MAX_BULK_BYTES: Final = 16 * KiB
"""Before AUTH: Redis refuses bulk arguments over 16 KiB (CVE-2021-32675 fix)."""
DEFAULT_LARGE_BULK_THRESHOLD: Final = 32 * KiB
"""Bulks this long or longer get a preallocated buffer (Redis PROTO_MBULK_BIG_ARG, 32 KiB)."""
DEFAULT_READ_BUFFER_BYTES: Final = 256 * KiB
"""Size of the scratch buffer lent to the socket for everything but large bulks."""

_INT_RE: Final = re.compile(rb"-?(?:0|[1-9][0-9]{0,18})")
_INT64_MAX: Final = 2**63 - 1
_INT64_MIN: Final = -(2**63)


def check_limits(**limits: int) -> None:
    """Raise `ValueError` naming the first limit that is not a positive integer of at
    most `MAX_LIMIT` (what the compiled twin's C integers leave room for)."""
    for name, value in limits.items():
        if value < 1:
            raise ValueError(f"invalid {name}: expected a positive integer (got {value!r})")
        if value > MAX_LIMIT:
            raise ValueError(f"invalid {name}: expected at most {MAX_LIMIT} (got {value!r})")


def protocol_error(detail: str) -> RemoteProtocolError:
    """The error for a protocol violation, in Redis' words: `Protocol error: <detail>`."""
    return RemoteProtocolError(f"Protocol error: {detail}")


def parse_int(raw: Buffer) -> int | None:
    """Strict signed 64-bit decimal (Redis `string2ll`), or None."""
    if _INT_RE.fullmatch(raw) is None:
        return None
    value = int(raw)
    if value > _INT64_MAX or value < _INT64_MIN:
        return None
    return value


def careful_head(
    data: bytearray, pos: int, end: int, what: str, max_line: int
) -> tuple[int | None, int]:
    """The `*N` / `$N` header at `pos` read the careful way (what the framer's one-step
    read passes over: a sign, a leading zero, many digits, a line cut short): (its value,
    or None when it is no strict integer, and where its CRLF ends), or (None, -1) while
    its line is not complete. A line longer than `max_line` is Redis' "too big <what>
    count string"."""
    cr = data.find(b"\r\n", pos, end)
    if cr < 0:
        # the line so far, without a CR that may be its end (whose LF is to come)
        if end - pos - (end > pos and data[end - 1] == 0x0D) > max_line:
            raise protocol_error(f"too big {what} count string")
        return None, -1
    if cr - pos > max_line:
        raise protocol_error(f"too big {what} count string")
    return parse_int(data[pos + 1 : cr]), cr + 2


def show_byte(b: int) -> str:
    """A byte as Redis shows it in "expected '$', got 'x'", escaped when unprintable."""
    return chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}"
