"""Redis glob patterns (`SCAN ... MATCH`, `CONFIG GET`) without catastrophic backtracking.

How it works
------------
The pattern is parsed exactly as Redis' `stringmatchlen` (util.c) reads it: `*` any run
of bytes, `?` one byte, `[abc]` / `[^abc]` / `[a-z]` (reversed ranges allowed, an
unterminated class runs to the end of the pattern), `\\x` the byte `x`. Every item but
`*` matches exactly one byte, so the pattern is a list of fixed-length *segments*
separated by stars: `S0 * S1 * ... * Sk`.

A string matches iff `S0` matches its start, `Sk` its end, and `S1..Sk-1` occur in order
in between without overlapping. Because every segment has a fixed length, taking the
leftmost occurrence of each middle segment is always optimal (it leaves the most room
for the rest), so no choice is ever revisited. Each segment is compiled to a regex
without any quantifier; one search costs at most O(n * len(segment)) and the whole match
O(n * m) for a string of n bytes and a pattern of m bytes, where the naive translation
`*` -> `.*` backtracks exponentially (`*a*a*a*a*b` on a long run of `a`s froze the
server: `re` holds the GIL for the whole call).

Patterns are capped at `MAX_PATTERN_BYTES`; with keys of at most 1024 bytes one match
is a bounded amount of work, and `Glob.cost` lets a caller budget many of them.
"""

from __future__ import annotations

import re
from typing import Final

from epistemic_kvcache.errors import RemoteProtocolError

MAX_PATTERN_BYTES: Final = 256
"""Longest pattern accepted (Redis has no limit; 256 bytes covers any sane key glob)."""

_ALL: Final = frozenset(range(256))


def _atom_regex(allowed: frozenset[int]) -> bytes:
    """A regex matching exactly one byte of `allowed` (no quantifier)."""
    if not allowed:
        return b"(?!)"
    if len(allowed) == 1:
        return re.escape(bytes(allowed))
    if allowed == _ALL:
        return b"[\\x00-\\xff]"
    out = bytearray(b"[")
    values = sorted(allowed)
    start = prev = values[0]
    for v in [*values[1:], -1]:
        if v == prev + 1:
            prev = v
            continue
        out += b"\\x%02x" % start
        if prev != start:
            out += b"-\\x%02x" % prev
        start = prev = v
    out += b"]"
    return bytes(out)


def parse_glob(pattern: bytes) -> list[frozenset[int] | None]:
    """The items of a Redis glob: None for `*`, else the set of bytes one position allows.

    Consecutive stars are kept (they are harmless); see `Glob` for matching.
    """
    items: list[frozenset[int] | None] = []
    p, n = pattern, len(pattern)
    i = 0
    while i < n:
        c = p[i]
        if c == 0x2A:  # '*'
            items.append(None)
        elif c == 0x3F:  # '?'
            items.append(_ALL)
        elif c == 0x5B:  # '[' -- a literal port of stringmatchlen's class loop
            i += 1
            negate = i < n and p[i] == 0x5E  # '^'
            if negate:
                i += 1
            allowed: set[int] = set()
            while True:
                if i < n and p[i] == 0x5C and n - i >= 2:  # '\\' escapes the next byte
                    i += 1
                    allowed.add(p[i])
                elif i < n and p[i] == 0x5D:  # ']'
                    break
                elif i >= n:  # unterminated: the class runs to the end of the pattern
                    i -= 1
                    break
                elif n - i >= 3 and p[i + 1] == 0x2D:  # 'a-z'
                    lo, hi = sorted((p[i], p[i + 2]))
                    allowed.update(range(lo, hi + 1))
                    i += 2
                else:
                    allowed.add(p[i])
                i += 1
            items.append(_ALL - allowed if negate else frozenset(allowed))
        else:
            if c == 0x5C and n - i >= 2:  # '\\': the next byte literally
                i += 1
                c = p[i]
            items.append(frozenset((c,)))
        i += 1
    return items


class Glob:
    """A compiled Redis glob. `match(s)` is True when the whole of `s` matches.

    Raises `RemoteProtocolError` for a pattern longer than `MAX_PATTERN_BYTES`.
    """

    __slots__ = ("_first", "_first_len", "_last", "_last_len", "_middle", "_star", "pattern")

    def __init__(self, pattern: bytes, *, max_bytes: int = MAX_PATTERN_BYTES) -> None:
        if len(pattern) > max_bytes:
            raise RemoteProtocolError(
                f"pattern too long: {len(pattern)} bytes (at most {max_bytes})"
            )
        self.pattern = bytes(pattern)
        segments: list[list[bytes]] = [[]]
        for item in parse_glob(self.pattern):
            if item is None:
                segments.append([])
            else:
                segments[-1].append(_atom_regex(item))
        compiled = [re.compile(b"".join(seg), re.DOTALL) for seg in segments]
        lengths = [len(seg) for seg in segments]
        self._star = len(segments) > 1
        self._first, self._first_len = compiled[0], lengths[0]
        self._last, self._last_len = compiled[-1], lengths[-1]
        self._middle = [c for c, n in zip(compiled[1:-1], lengths[1:-1], strict=True) if n]

    def cost(self, n: int) -> int:
        """Upper bound of the regex steps one match of an `n`-byte string takes."""
        return max(1, n) * max(1, len(self.pattern))

    def match(self, s: bytes) -> bool:
        """Whether all of `s` matches (Redis: a non-empty pattern never matches b"")."""
        n = len(s)
        if not n:
            return not self.pattern
        if not self._star:
            return n == self._first_len and self._first.match(s) is not None
        end = n - self._last_len
        if end < self._first_len:
            return False
        if self._first_len and self._first.match(s) is None:
            return False
        if self._last_len and self._last.match(s, end) is None:
            return False
        pos = self._first_len
        for seg in self._middle:
            m = seg.search(s, pos, end)
            if m is None:
                return False
            pos = m.end()
        return True
