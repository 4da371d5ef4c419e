"""Test-only: LMCache's v1 (in-process) connector on a CPU-only vLLM.

What it replaces: LMCache 0.5.6's `CreateGPUConnector` has paged-KV copy kernels for
CUDA, XPU, MUSA and HPU only; on vLLM's CPU build it raises `No supported cpu connector
found`. The "GPU connector" is the piece that copies a chunk's K/V between vLLM's paged
KV cache and an LMCache `MemoryObj` (format KV_2LTD: `[2, layers, tokens, heads*dim]`).
`CPUPagedConnector` does that copy with plain torch indexing over vLLM's CPU layout
(per layer `[blocks, kv_heads, block_size, 2 * head_size]`: a block's keys, then its
values). Everything else, LMCache's engine, its storage manager and our plugins and
server, is the real code: on a GPU machine LMCache's own CUDA connector takes this
place and nothing else changes.

vLLM imports this module in each of its processes through `kv_connector_module_path`
(`kv_connector="LMCacheCPUConnectorV1"`); importing it installs the replacement.

Importing it also closes a race in LMCache's v1 native-client base class that `resp://`
runs into (tests/e2e/lmcache_client_race.py; not CPU-specific: a GPU has it too).

`LMCacheCPUMPConnector` is LMCache's MP connector (`LMCacheMPConnector`, unchanged) loaded
the same way, so that tests/e2e/lmcache_cpu_mp.py's patches to LMCache's CPU server-driven
transfer are installed in the vLLM process that registers its KV cache (the hybrid tests).
"""

from __future__ import annotations

from typing import Any

import lmcache.v1.gpu_connector as gpu_connector
import lmcache_client_race
import lmcache_cpu_mp  # noqa: F401  (importing it installs its patches)
import torch
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1,
)


class CPUPagedConnector(GPUConnectorInterface):  # type: ignore[misc]
    """Copies chunks between vLLM's CPU paged KV cache and KV_2LTD `MemoryObj`s."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers = num_layers
        self.hidden = num_kv_heads * head_size
        self.kvcaches: list[torch.Tensor] | None = None

    def _slots(self, kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
        self.initialize_kvcaches_ptr(**kwargs)
        assert self.kvcaches is not None, "vLLM passed no kvcaches"
        slots: torch.Tensor = kwargs["slot_mapping"][start:end]
        return slots.long()

    @staticmethod
    def _blocks(kv: torch.Tensor) -> torch.Tensor:
        """`[blocks, heads, block_size, 2*dim]` viewed as `[blocks, heads, 2, block_size, dim]`."""
        nb, nh, bs, two_d = kv.shape
        return kv.view(nb, nh, 2, bs, two_d // 2)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = self._slots(kwargs, start, end)
        n = end - start
        assert self.kvcaches is not None
        for i, kv in enumerate(self.kvcaches):
            b = self._blocks(kv)
            bs = b.shape[3]
            picked = b[slots // bs, :, :, slots % bs, :]  # [tokens, heads, 2, dim]
            memory_obj.tensor[:, i, :n].copy_(picked.permute(2, 0, 1, 3).reshape(2, n, -1))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = self._slots(kwargs, start, end)
        n = end - start
        assert self.kvcaches is not None
        for i, kv in enumerate(self.kvcaches):
            b = self._blocks(kv)
            bs, dim = b.shape[3], b.shape[4]
            src = memory_obj.tensor[:, i, :n].reshape(2, n, -1, dim).permute(1, 2, 0, 3)
            b[slots // bs, :, :, slots % bs, :] = src.to(kv.dtype)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])


_stock = gpu_connector.CreateGPUConnector


def _create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
    if engine == EngineType.VLLM and not torch.cuda.is_available():
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return CPUPagedConnector(num_layers, num_kv_heads, head_size)
    return _stock(config, metadata, engine, layout_hints)


gpu_connector.CreateGPUConnector = _create
lmcache_client_race.install()


class LMCacheCPUConnectorV1(LMCacheConnectorV1):  # type: ignore[misc]
    """vLLM's stock `LMCacheConnectorV1`, loaded from here so the patch above is in place."""


class LMCacheCPUMPConnector(LMCacheMPConnector):  # type: ignore[misc]
    """LMCache's `LMCacheMPConnector`, loaded from here so its CPU patches are in place."""
