"""Warm-tier codec: byte/bit shuffle + a fast LZ codec through blosc2.

Why this codec (measured with bench/bench_store.py on bf16-shaped data, 4 MiB of
normally distributed values truncated to bfloat16, on this project's 2-core CI machine):

| codec            | ratio | compress | decompress |
|------------------|-------|----------|------------|
| lz4 + bitshuffle | 0.76  | ~2.0 GB/s| ~2.7 GB/s  |
| zstd(1) + shuffle| 0.69  | ~0.5 GB/s| ~1.6 GB/s  |
| lz4 + shuffle    | 0.88  | ~0.7 GB/s| ~1.6 GB/s  |

The sign/exponent byte of bf16 compresses well, the mantissa byte hardly at all; bit
shuffling lets LZ4 find the exponent runs at memory-ish speed. zstd saves another 9% of
the block but compresses 4x slower, and the warm tier sits on the demotion path of every
PUT under pressure, so the default is lz4 + bitshuffle; `zstd` is an option.

A block whose compressed size is above `max_ratio` of the original is "not worth it":
`compress` returns None and the caller keeps it raw or lets it skip the tier.

Slices. blosc2 holds the GIL for a whole call: compressing a 128 MiB block took
0.3-1.3 s and decompressing it 0.25-0.45 s here, all that time with no other thread
running, the event loop included (every other client stalled: a large block demoted
to warm, or paged back in from it). So a block above `SLICE_BYTES` is compressed as a
run of independent blosc2 chunks of `SLICE_BYTES` each, back to back (each chunk's
header holds its own sizes, so the run needs no framing of its own), and decompressed
chunk by chunk into one buffer: the GIL is held for one slice at a time (~2-10 ms).
"""

from __future__ import annotations

from typing import Literal

import blosc2

from epistemic_kvcache.buffers import read_buffer
from epistemic_kvcache.errors import ConfigurationError

CodecName = Literal["lz4", "zstd"]

_CODECS = {"lz4": blosc2.Codec.LZ4, "zstd": blosc2.Codec.ZSTD}
# blosc2 works on chunks of at most 2 GiB; our blocks are far smaller (max_block_bytes).
_MAX_CHUNK = 2**31 - 64
SLICE_BYTES = 4 << 20
"""Largest piece of a block compressed or decompressed in one (GIL-holding) blosc2 call."""
_HEADER_BYTES = 32  # a blosc2 chunk's header: nbytes at 4..8, cbytes at 12..16


class WarmCodec:
    """Lossless compression for the warm tier. Thread-safe (blosc2 calls are reentrant)."""

    def __init__(
        self,
        codec: CodecName = "lz4",
        *,
        level: int = 1,
        typesize: int = 2,
        max_ratio: float = 0.9,
    ) -> None:
        if codec not in _CODECS:
            raise ConfigurationError(f"invalid warm_codec: expected lz4 or zstd (got {codec!r})")
        if not 0.0 < max_ratio <= 1.0:
            raise ConfigurationError(f"invalid warm_max_ratio: expected (0, 1] (got {max_ratio!r})")
        self.name = codec
        self._codec = _CODECS[codec]
        self._level = level
        # bf16/fp16 KV: typesize 2 puts the exponent bits of every element side by side.
        self._typesize = typesize
        self.max_ratio = max_ratio

    def compress(self, data: bytes | bytearray | memoryview) -> bytes | None:
        """Compressed bytes, or None when the block does not compress below `max_ratio`."""
        n = len(data)
        if n == 0 or n > _MAX_CHUNK:
            return None
        typesize = self._typesize if n % self._typesize == 0 else 1
        view = memoryview(data).cast("B")
        parts: list[bytes] = []
        size = 0
        for start in range(0, n, SLICE_BYTES):
            part: bytes = blosc2.compress2(
                view[start : start + SLICE_BYTES],
                typesize=typesize,
                clevel=self._level,
                filters=[blosc2.Filter.BITSHUFFLE],
                codec=self._codec,
            )
            size += len(part)
            if size > n * self.max_ratio:
                return None  # not worth it: known before the rest is compressed
            parts.append(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @staticmethod
    def decompress(data: bytes) -> bytes | memoryview:
        """Inverse of `compress`. Raises ValueError on a damaged frame."""
        try:
            chunks = _chunks(data)
            if len(chunks) == 1:
                out = blosc2.decompress2(data)
                return bytes(out) if not isinstance(out, bytes) else out
            total = sum(nbytes for _start, _cbytes, nbytes in chunks)
            buf = memoryview(read_buffer(total))
            src = memoryview(data)
            at = 0
            for start, cbytes, nbytes in chunks:  # one slice per GIL-holding call
                blosc2.decompress2(src[start : start + cbytes], dst=buf[at : at + nbytes])
                at += nbytes
        except Exception as exc:  # blosc2 raises RuntimeError/ValueError on bad frames
            raise ValueError(f"damaged warm-tier frame: {exc}") from exc
        return buf


def _chunks(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, compressed size, size) of each blosc2 chunk of a `compress` output."""
    out = []
    start = 0
    while start < len(data):
        if len(data) - start < _HEADER_BYTES:
            raise ValueError("truncated chunk header")
        nbytes = int.from_bytes(data[start + 4 : start + 8], "little")
        cbytes = int.from_bytes(data[start + 12 : start + 16], "little")
        if not _HEADER_BYTES <= cbytes <= len(data) - start or nbytes > _MAX_CHUNK:
            raise ValueError(f"chunk at {start}: sizes {nbytes}/{cbytes} do not fit")
        out.append((start, cbytes, nbytes))
        start += cbytes
    if not out:
        raise ValueError("empty frame")
    return out
