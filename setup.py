"""Build the optional compiled twins (Cython), or skip them cleanly.

Everything else about the package is in pyproject.toml. Each twin has one source, a
pure-Python module that Cython also compiles (its "pure Python mode", with the C types
of the `.pxd` beside it) into an extension module:
- src/epistemic_kvcache/proto/resp_parser.py -> `epistemic_kvcache.proto._resp_parser_c`
  (the RESP framer; proto/resp_framer.py imports it when present);
- src/epistemic_kvcache/store/hotcore.py -> `epistemic_kvcache.store._hotcore_c` (the
  store's records and hit paths; store/core.py imports it when present);
- src/epistemic_kvcache/server/resp/fastpath.py ->
  `epistemic_kvcache.server.resp._fastpath_c` (`run_fast`, RESP's inline dispatcher;
  server/resp/fast.py imports it when present).

The extensions are optional: without Cython or without a C compiler, or with
`EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD=1`, the package builds without them (one line says
so) and runs the pure-Python twins.

Each extension is stamped with the sources it was built from: Cython compiles a copy of
the pure module (under build/twin-src/, named as the extension, with its `.pxd`) that
ends in `__twin_stamp__ = "<sha256 of the .py and the .pxd>"`. At import
(`epistemic_kvcache.twins.select`) a compiled twin whose stamp is not the hash of the
sources beside it is stale and is not used; the tests fail on it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

PURE_BUILD_ENV = "EPISTEMIC_GRAPH_KVCACHE_PURE_BUILD"
# (extension module, its pure-Python source)
TWINS = [
    ("epistemic_kvcache.proto._resp_parser_c", "src/epistemic_kvcache/proto/resp_parser.py"),
    ("epistemic_kvcache.store._hotcore_c", "src/epistemic_kvcache/store/hotcore.py"),
    (
        "epistemic_kvcache.server.resp._fastpath_c",
        "src/epistemic_kvcache/server/resp/fastpath.py",
    ),
]


TWIN_SRC = Path("build/twin-src")


def source_stamp(source: bytes, pxd: bytes) -> str:
    """The stamp of a twin's sources (`epistemic_kvcache.twins.source_stamp`, the same)."""
    return hashlib.sha256(source + b"\0" + pxd).hexdigest()


def _stamped_copy(module: str, source: str) -> str:
    """A copy of `source` named as the extension `module`, beside a copy of its `.pxd`
    and under the package's `__init__.py` files (so Cython gives it its full name),
    ending in its stamp. Returns the copy's path."""
    parts = module.split(".")
    src, pxd = Path(source), Path(source).with_name(parts[-1] + ".pxd")
    folder = TWIN_SRC.joinpath(*parts[:-1])
    folder.mkdir(parents=True, exist_ok=True)
    for depth in range(1, len(parts)):
        TWIN_SRC.joinpath(*parts[:depth], "__init__.py").touch()
    code, types = src.read_bytes(), pxd.read_bytes()
    stamp = f'\n__twin_stamp__ = "{source_stamp(code, types)}"\n'.encode()
    copy = folder / (parts[-1] + ".py")
    if not copy.exists() or copy.read_bytes() != code + stamp:  # (unchanged: no rebuild)
        copy.write_bytes(code + stamp)
    if not (folder / pxd.name).exists() or (folder / pxd.name).read_bytes() != types:
        shutil.copyfile(pxd, folder / pxd.name)
    return str(copy)


_said: set[str] = set()


def _say(message: str) -> None:
    print(f"epistemic-kvcache: {message}", file=sys.stderr)


def _not_built(exc: BaseException) -> None:
    """Say once why the compiled twin is not built (a failed compile also fails the
    copy of its output after it: that one is not said again)."""
    if not _said:
        _said.add("not built")
        _say(f"compiled twins not built ({exc}); using the pure-Python ones")


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
    exts = [
        Extension(m, sources=[_stamped_copy(m, src)], extra_compile_args=["-g0"])
        for m, src in TWINS
    ]
    try:
        return list(
            cythonize(
                exts,
                # annotations are for mypy; the C types come from the .pxd alone
                compiler_directives={"language_level": "3", "annotation_typing": False},
                quiet=True,
                build_dir="build/cython",
            )
        )
    except Exception as exc:
        _say(f"compiled twins not built (Cython: {exc}); using the pure-Python ones")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
