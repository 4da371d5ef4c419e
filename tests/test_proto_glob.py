"""Redis glob matching (`proto/glob.py`): Redis' own semantics, bounded work."""

from __future__ import annotations

import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from epistemic_kvcache.errors import RemoteProtocolError
from epistemic_kvcache.proto.glob import MAX_PATTERN_BYTES, Glob


def redis_stringmatch(p: bytes, s: bytes) -> bool:
    """A line-by-line port of Redis' recursive `stringmatchlen` (util.c, 7.0.10+ with
    the `skipLongerMatches` cut-off of CVE-2022-36021), case-sensitive. Slow: the oracle.
    """
    return _stringmatch(p, s, [False])


def _stringmatch(p: bytes, s: bytes, skip_longer: list[bool]) -> bool:
    pi = si = 0
    pl, sl = len(p), len(s)
    while pl and sl:
        c = p[pi]
        if c == ord("*"):
            while pl > 1 and p[pi + 1] == ord("*"):
                pi, pl = pi + 1, pl - 1
            if pl == 1:
                return True
            while sl:
                if _stringmatch(p[pi + 1 :], s[si:], skip_longer):
                    return True
                if skip_longer[0]:
                    return False
                si, sl = si + 1, sl - 1
            skip_longer[0] = True
            return False
        if c == ord("?"):
            si, sl = si + 1, sl - 1
        elif c == ord("["):
            pi, pl = pi + 1, pl - 1
            neg = pl > 0 and p[pi] == ord("^")
            if neg:
                pi, pl = pi + 1, pl - 1
            match = False
            while True:
                cur = p[pi] if pl > 0 else 0  # C reads the NUL terminator
                if cur == ord("\\") and pl >= 2:
                    pi, pl = pi + 1, pl - 1
                    if p[pi] == s[si]:
                        match = True
                elif cur == ord("]"):
                    break
                elif pl == 0:
                    pi, pl = pi - 1, pl + 1
                    break
                elif pl >= 3 and p[pi + 1] == ord("-"):
                    lo, hi = sorted((p[pi], p[pi + 2]))
                    pi, pl = pi + 2, pl - 2
                    if lo <= s[si] <= hi:
                        match = True
                elif cur == s[si]:
                    match = True
                pi, pl = pi + 1, pl - 1
            if neg:
                match = not match
            if not match:
                return False
            si, sl = si + 1, sl - 1
        else:
            if c == ord("\\") and pl >= 2:
                pi, pl = pi + 1, pl - 1
            if p[pi] != s[si]:
                return False
            si, sl = si + 1, sl - 1
        pi, pl = pi + 1, pl - 1
        if sl == 0:
            while pl and p[pi] == ord("*"):
                pi, pl = pi + 1, pl - 1
            break
    return pl == 0 and sl == 0


CASES = [
    (b"*", b"anything", True),
    (b"*", b"", False),  # Redis: nothing but the empty pattern matches b""
    (b"", b"", True),
    (b"a?c", b"abc", True),
    (b"a?c", b"ac", False),
    (b"h[ae]llo", b"hallo", True),
    (b"h[^e]llo", b"hello", False),
    (b"h[a-b]llo", b"hbllo", True),
    (b"h[b-a]llo", b"hallo", True),  # reversed range
    (b"h\\*llo", b"h*llo", True),
    (b"h\\*llo", b"hello", False),
    (b"k.y", b"kxy", False),
    (b"a[]b", b"a]b", False),  # an empty class matches nothing ...
    (b"a[^]b", b"axb", True),  # ... and its negation everything
    (b"a[bc", b"ab", True),  # an unterminated class runs to the end
    (b"a[\\]]b", b"a]b", True),
    (b"*a*a*a*b", b"a" * 500, False),
    (b"*a*a*a*b", b"a" * 500 + b"b", True),
    (b"pre*mid*suf", b"pre-mid-suf", True),
    (b"pre*mid*suf", b"premidsuf", True),
    (b"pre*mid*suf", b"presuf", False),
    (b"ab*ba", b"aba", False),  # prefix and suffix may not overlap
    (b"\\", b"\\", True),  # a trailing backslash is literal
    (b"\x00*\xff", b"\x00abc\xff", True),
]


@pytest.mark.parametrize(("pattern", "s", "expected"), CASES)
def test_cases_agree_with_redis(pattern: bytes, s: bytes, expected: bool) -> None:
    assert redis_stringmatch(pattern, s) is expected
    assert Glob(pattern).match(s) is expected


@settings(max_examples=2000, deadline=None)
@given(
    st.binary(max_size=10).map(lambda b: bytes(b"ab*?[]^-\\"[x % 9] for x in b)),
    st.binary(max_size=10).map(lambda b: bytes(b"ab]^-\\*"[x % 7] for x in b)),
)
@example(b"[a-]b", b"]")
@example(b"[\\", b"\\")
@example(b"*[^", b"ab")
def test_glob_equals_redis_stringmatchlen(pattern: bytes, s: bytes) -> None:
    assert Glob(pattern).match(s) is redis_stringmatch(pattern, s), (pattern, s)


ADVERSARIAL = [
    b"*a*a*a*a*a*a*a*a*a*b",
    b"*" + b"a" * 250 + b"b*",
    b"*" + b"?" * 250 + b"b*",
    b"*" + b"?a" * 125 + b"b*",
    b"*" + b"[ab]" * 62 + b"c*",
    b"*a" * 127 + b"b",
    b"?*" * 128,
]


@pytest.mark.parametrize("pattern", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_matching_is_polynomial_on_adversarial_patterns(pattern: bytes) -> None:
    glob = Glob(pattern)
    s = b"a" * 1024  # the longest key
    # This thread's CPU time: the matching's own cost, whatever else the machine runs
    # (about 1 ms per match at most here).
    started = time.thread_time()
    for _ in range(20):
        glob.match(s)
    per_match = (time.thread_time() - started) / 20
    # The regex translation `*` -> `.*` takes minutes to forever on these.
    assert per_match < 0.02, f"{per_match * 1e3:.1f} ms per match"


def test_long_patterns_are_refused() -> None:
    Glob(b"*" * MAX_PATTERN_BYTES)
    with pytest.raises(RemoteProtocolError, match="pattern too long"):
        Glob(b"*" * (MAX_PATTERN_BYTES + 1))
