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
"""

from __future__ import annotations

from typing import Literal

import blosc2

from epistemic_kvcache.errors import ConfigurationError

CodecName = Literal["lz4", "zstd"]

_CODECS = {"lz4": blosc2.Codec.LZ4, "zstd": blosc2.Codec.ZSTD}
# blosc2 works on chunks of at most 2 GiB; our blocks are far smaller (max_block_bytes).
_MAX_CHUNK = 2**31 - 64


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
        out: bytes = blosc2.compress2(
            data,
            typesize=typesize,
            clevel=self._level,
            filters=[blosc2.Filter.BITSHUFFLE],
            codec=self._codec,
        )
        if len(out) > n * self.max_ratio:
            return None
        return out

    @staticmethod
    def decompress(data: bytes) -> bytes:
        """Inverse of `compress`. Raises ValueError on a damaged frame."""
        try:
            out = blosc2.decompress2(data)
        except Exception as exc:  # blosc2 raises RuntimeError/ValueError on bad frames
            raise ValueError(f"damaged warm-tier frame: {exc}") from exc
        return bytes(out) if not isinstance(out, bytes) else out
