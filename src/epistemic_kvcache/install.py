"""Where the package installs from: the repository, until it is published on PyPI.

Every install hint the package prints (a missing extra, a missing LMCache) comes from
`pip_hint`, so the day it is published one line changes.
"""

from __future__ import annotations

REPOSITORY = "https://github.com/epistemic-kvcache/epistemic-kvcache"


def pip_hint(extra: str | None = None) -> str:
    """The command that installs the package (with `extra`), and where it comes from."""
    name = f"epistemic-kvcache[{extra}]" if extra else "epistemic-kvcache"
    local = f"'.[{extra}]'" if extra else "."
    return (
        f"pip install '{name} @ git+{REPOSITORY}' (not on PyPI yet: from the repository; "
        f"in a checkout, pip install {local})"
    )
