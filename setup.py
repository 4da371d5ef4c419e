"""Build the optional compiled twin of the RESP framer (Cython), or skip it cleanly.

Everything else about the package is in pyproject.toml. `RespParser` has one source,
src/epistemic_kvcache/proto/resp_parser.py: the pure-Python reference, which Cython
also compiles (its "pure Python mode", with the C types of
src/epistemic_kvcache/proto/_resp_parser_c.pxd) into the extension module
`epistemic_kvcache.proto._resp_parser_c`; proto/resp_framer.py imports it when present.

The extension is optional: without Cython or without a C compiler, or with
`EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD=1`, the package builds without it (one line says
so) and runs the pure-Python twin.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

PURE_BUILD_ENV = "EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD"
MODULE = "epistemic_kvcache.proto._resp_parser_c"
SOURCE = "src/epistemic_kvcache/proto/resp_parser.py"


_said: set[str] = set()


def _say(message: str) -> None:
    print(f"epistemic-kvcache: {message}", file=sys.stderr)


def _not_built(exc: BaseException) -> None:
    """Say once why the compiled twin is not built (a failed compile also fails the
    copy of its output after it: that one is not said again)."""
    if not _said:
        _said.add("not built")
        _say(f"compiled RESP framer not built ({exc}); using the pure-Python one")


class OptionalBuildExt(build_ext):
    """build_ext that leaves the package pure when the compiler fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            _not_built(exc)

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:
            _not_built(exc)


def _extensions() -> list[object]:
    if os.environ.get(PURE_BUILD_ENV, "") not in {"", "0"}:
        _say(f"{PURE_BUILD_ENV} is set: building the pure-Python package")
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        _say("Cython is not installed: building the pure-Python package")
        return []
    # -g0: no debug info (the .so shrinks from 1.8 MB to a few hundred KB)
    ext = Extension(MODULE, sources=[SOURCE], extra_compile_args=["-g0"])
    try:
        return list(
            cythonize(
                [ext],
                # annotations are for mypy; the C types come from the .pxd alone
                compiler_directives={"language_level": "3", "annotation_typing": False},
                quiet=True,
                build_dir="build/cython",
            )
        )
    except Exception as exc:
        _say(f"compiled RESP framer not built (Cython: {exc}); using the pure-Python one")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
