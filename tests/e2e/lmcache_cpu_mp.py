"""Test-only: LMCache MP's server-driven transfer (`lmcache_driven`) on a CPU-only vLLM.

A hybrid model (GDN/Mamba layers beside attention) needs this path: LMCache 0.5.6's
engine-driven transfer refuses more than one KV transfer group (`EngineDrivenTransferContext
.register`, lmcache/v1/multiprocess/transfer_context/worker_transfer.py: "engine-driven
transfer does not support multiple KV transfer groups now"), and a hybrid model has two
(attention pages and recurrent-state pages). Server-driven transfer on a CPU shares vLLM's
KV cache with `lmcache server` through POSIX shared memory, and three pieces of that code
fail on a hybrid model's cache. Each patch below is the smallest change that lets LMCache's
own code run; everything else (the connector, the server, its L2 adapters, our plugin and
server) is unchanged.

1. `migrate_to_shm_and_wrap` and `CpuShmTensorWrapper` (lmcache/v1/platform/devices/cpu/
   shm.py) refuse a non-contiguous tensor. vLLM pads a GDN state page (35,840 bytes here)
   to the attention page's stride (65,536), and LMCache's own `_MambaUnifiedViewEdit`
   (lmcache/integration/vllm/kv_cache_group_edits.py) hands over that padded, strided
   view. The patch migrates the whole backing storage through LMCache's function (with a
   contiguous byte view of it) and describes the strided view in the wrapper; the wrapper's
   `to_tensor` already rebuilds any stride with `as_strided`. On a GPU, `CudaIPCWrapper`
   (lmcache/v1/platform/devices/cuda/ipc_wrapper.py) carries shape, stride and offset
   with no contiguity check, and nothing is migrated: vLLM's memory is shared in place.
2. Migration copies the storage into shared memory and re-points only the tensor it was
   handed (`tensor.set_(...)`). vLLM's GDN layers hold their own views of that storage
   (conv and SSM state), so they would go on writing the old memory while LMCache reads
   the new: stale recurrent state is stored, and a later load is written where vLLM does
   not read. (Attention works because vLLM hands LMCache the very tensor its layer uses.)
   The patch re-points every live tensor on the migrated storage. A GPU never migrates
   (CUDA IPC maps vLLM's own allocation), so every view stays valid.
3. In the server, `_normalize_paged_layers` (lmcache/v1/platform/torch_ops/
   mp_mem_kernels.py), the non-CUDA fallback that rebuilds paged tensors from raw
   pointers, refuses a block stride wider than the block ("Non-tight per-block strides
   (vLLM blocks-first pools) are not supported ... in the non-CUDA fallback"). The patch
   builds the same view with the block stride (`as_strided`). On a GPU the CUDA kernels
   take `block_stride_elems` themselves.

Importing this module installs all three (each touches only its own function, so the
vLLM process and `lmcache server` can both import it). `python lmcache_cpu_mp.py ARGS`
runs the `lmcache` command with them installed (`lmcache server ...`).
"""

from __future__ import annotations

import gc
import math
import sys
from typing import Any

import lmcache.v1.platform.devices.cpu.shm as shm
import lmcache.v1.platform.torch_ops.mp_mem_kernels as mp_mem_kernels
import torch
from lmcache.v1.gpu_connector.kv_format.contiguity import attempt_permute_to_contiguous_view
from lmcache.v1.platform.torch_ops._tensor_from_ptr import _tensor_from_ptr

_stock_migrate = shm.migrate_to_shm_and_wrap
_stock_normalize = mp_mem_kernels._normalize_paged_layers
NON_TIGHT = "Non-tight per-block strides"


def _repoint_views(old: torch.UntypedStorage, new: torch.UntypedStorage) -> int:
    """Patch 2: every live tensor still on `old` now views the same bytes of `new`."""
    old_ptr, moved = old.data_ptr(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() == old_ptr and storage.nbytes() == new.nbytes():
            obj.set_(new, obj.storage_offset(), obj.shape, obj.stride())
            moved += 1
    return moved


def migrate_to_shm_and_wrap(tensor: torch.Tensor) -> shm.CpuShmTensorWrapper:
    """Patches 1 and 2 around LMCache's `migrate_to_shm_and_wrap`."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return _stock_migrate(tensor)
    old = tensor.untyped_storage()
    normalized = attempt_permute_to_contiguous_view(tensor)
    if normalized.is_contiguous():
        wrapper = _stock_migrate(tensor)
    else:
        # LMCache's own migration, handed a contiguous byte view of the whole storage.
        whole = torch.empty(0, dtype=torch.uint8).set_(old)
        wrapper = _stock_migrate(whole)
        tensor.set_(
            whole.untyped_storage(),
            normalized.storage_offset(),
            normalized.shape,
            normalized.stride(),
        )
        wrapper.dtype = tensor.dtype
        wrapper.shape = tuple(tensor.shape)
        wrapper.stride = tuple(tensor.stride())
        wrapper.storage_offset = int(tensor.storage_offset())
    new = tensor.untyped_storage()
    if new.data_ptr() != old.data_ptr():
        moved = _repoint_views(old, new)
        print(f"lmcache_cpu_mp: re-pointed {moved} more views onto shared memory", file=sys.stderr)
    return wrapper


def _normalize_paged_layers(
    paged_buffer_ptrs_tensor: Any,
    format_spec: Any,
    shape_desc: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Any:
    """Patch 3: where LMCache refuses a non-tight block stride, build the strided view."""
    try:
        return _stock_normalize(paged_buffer_ptrs_tensor, format_spec, shape_desc, device, dtype)
    except NotImplementedError as exc:
        if NON_TIGHT not in str(exc):
            raise
    nb, bs = int(shape_desc.nb), int(shape_desc.bs)
    nh, hs = int(shape_desc.nh), int(shape_desc.hs)
    shape = tuple(format_spec.paged_layer_shape(nb, bs, nh, hs))
    if shape[0] != nb:
        raise NotImplementedError(f"a non-tight block stride on a layout not blocks-first: {shape}")
    block_stride = int(shape_desc.block_stride_elems)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    strides[0] = block_stride
    span = (nb - 1) * block_stride + math.prod(shape[1:])
    return [
        torch.as_strided(_tensor_from_ptr(int(p.item()), (span,), dtype, device), shape, strides)
        for p in paged_buffer_ptrs_tensor
    ]


def install() -> None:
    # Both are looked up by module-global name at each call (`CpuShmTensorWrapper.wrap`,
    # `multi_layer_block_kv_transfer`), so replacing the module attributes suffices.
    shm.migrate_to_shm_and_wrap = migrate_to_shm_and_wrap
    mp_mem_kernels._normalize_paged_layers = _normalize_paged_layers


install()

if __name__ == "__main__":
    from lmcache.cli.main import main

    sys.argv[0] = "lmcache"
    sys.exit(main())
