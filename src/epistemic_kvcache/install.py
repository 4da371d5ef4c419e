"""Where the package installs from: the repository, until it is published on PyPI.

Every install hint the package prints (a missing extra, a missing LMCache) comes from
`pip_hint`, so the day it is published one line changes; `require_extra` is how a
command (`cli`, `mcp_tools`) checks for an optional dependency group.
"""

from __future__ import annotations

import importlib.util

from epistemic_kvcache.errors import KvCacheError

REPOSITORY = "https://github.com/epistemic-kvcache/epistemic-kvcache"


def pip_hint(extra: str | None = None) -> str:
    """The command that installs the package (with `extra`), and where it comes from."""
    name = f"epistemic-kvcache[{extra}]" if extra else "epistemic-kvcache"
    local = f"'.[{extra}]'" if extra else "."
    return (
        f"pip install '{name} @ git+{REPOSITORY}' (not on PyPI yet: from the repository; "
        f"in a checkout, pip install {local})"
    )


class MissingExtraError(KvCacheError):
    """A subcommand needs an optional dependency group that is not installed."""


def require_extra(extra: str, *modules: str) -> None:
    """Raise `MissingExtraError` naming the command that installs `extra` (`pip_hint`)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"this command needs the '{extra}' extra ({', '.join(missing)} not installed): "
            + pip_hint(extra)
        )
