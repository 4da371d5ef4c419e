"""The repository's prose says what is, and its links lead somewhere.

- No sentence dates itself by the round of work that wrote it: a figure or a decision
  is stated with its command and method, and its history is in CHANGELOG.md and git.
  `DATED` lists the phrases that did so (a work session named by its ordinal, "this
  session", "the last session", a round of work dated by its day); every tracked text
  file is searched, CHANGELOG.md included: a changelog entry is dated by its release,
  not by a session. A context `Session` (docs/context-bundles.md) is a different word:
  the patterns name sessions of work only.
- Every relative link in README.md and docs/*.md names a file that exists, and every
  `#anchor` names a heading of that file (GitHub's slugs).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
    r"twentieth|\d+(?:st|nd|rd|th)"
)
DATED = re.compile(
    rf"\b(?:{ORDINALS})(?:\s+and\s+(?:{ORDINALS}))?\s+sessions?\b"
    r"|\b(?:this|that|last|earlier|previous|next|same)\s+session(?:'s)?\b"
    r"|\bsessions?\s+(?:above|before\s+this)\b"
    r"|\b\d{4}-\d{2}-\d{2},?\s+(?:round|session)\b"
    r"|\b(?:this|last|earlier|previous)\s+round\s+of\s+work\b",
    re.IGNORECASE,
)
TEXT_SUFFIXES = {".md", ".py", ".pyx", ".pxd", ".toml", ".cfg", ".txt", ".yaml", ".yml",
                 ".json", ".sh", ".ini", ".in", ""}  # fmt: skip


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    out = []
    for raw in filter(None, names):
        path = ROOT / raw.decode()
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            out.append(path)
    return out


def test_the_pattern_finds_dated_sentences_and_leaves_context_sessions() -> None:
    dated = [
        "### The floor (2026-12-03, sixth session)",
        "measured in the eleventh and twelfth sessions",
        "On this session's machine it read 4.7 us",
        "against 3.3 us last session",
        "the 21st session measured it",
        "The sessions above looked for it",
        "the 2026-12-05 round",
    ]
    plain = [
        "session = Session('sess-42', tenant='acme')",
        "Named supporters the session cannot see",
        "a foreground server session",
        "every loop's RESP sessions",
        "medians of 3 rounds; round 1 / round 2",
    ]
    assert [s for s in dated if not DATED.search(s)] == []
    assert [s for s in plain if DATED.search(s)] == []


def test_no_sentence_dates_itself_by_a_session_of_work() -> None:
    found = []
    for path in tracked_text_files():
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DATED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert found == [], "say what is (figure, command, method); history goes to git:\n" + "\n".join(
        found
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
    return {s if i == 0 else f"{s}-{i}" for s, n in seen.items() for i in range(n + 1)}


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", doc.read_text()):
            target, anchor = m.group(1), m.group(2)
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path = (doc.parent / target) if target else doc
            if not path.exists():
                broken.append(f"{doc.name}: {m.group(0)} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.name}: {m.group(0)} (no such heading)")
    assert broken == [], "\n".join(broken)
