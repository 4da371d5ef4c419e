"""Token counting for budget fitting.

`TokenCounter` is a protocol (`name`, `count(text)`), so a real tokenizer can be plugged
in (the name goes into bundle cache keys: different counters give different bundles).
`ApproxTokenCounter`, the default, needs no downloads: it splits text into word runs and
single punctuation marks and charges a word one token per started 5 characters, which
tracks BPE tokenizers (about 4 characters per token in English) on the high side, so a
fitted bundle rarely overshoots a real tokenizer's count.
"""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

_PIECES = re.compile(r"\w+|[^\w\s]")


@runtime_checkable
class TokenCounter(Protocol):
    """Counts tokens of a text. `name` identifies the tokenizer in cache keys."""

    @property
    def name(self) -> str:
        """A stable identifier, e.g. `approx-v1` or `hf:meta-llama/Llama-3-8B`."""
        ...

    def count(self, text: str) -> int:
        """Number of tokens `text` encodes to."""
        ...


class ApproxTokenCounter:
    """Download-free estimate: `ceil(len(word) / 5)` per word run, 1 per punctuation mark."""

    @property
    def name(self) -> str:
        """`approx-v1`."""
        return "approx-v1"

    def count(self, text: str) -> int:
        """Estimated token count of `text`."""
        return sum((len(p) + 4) // 5 for p in _PIECES.findall(text))
