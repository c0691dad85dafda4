"""Triton copy_blocks: copy whole blocks (copy-on-write) in every layer's K and V cache, one launch.

Program (pair, cache) copies block src -> dst of one cache; the caches are reached
through a table of their data pointers, so the layers need not share one tensor.
Each block is contiguous; blocks are BLOCK_STRIDE elements apart (more than a block's
size in the engine's block-major cache, where the layers are strided views).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from folio.kernels.errors import KernelInputError

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs,  # [num_caches] int64: data pointer of each [num_blocks, block_size, kv_heads, head_dim] cache
    block_mapping_ptr,  # [num_pairs, 2] int64: (src block, dst block)
    block_stride,  # elements from one block's start to the next's (cache.stride(0))
    BLOCK_NUMEL: tl.constexpr,  # elements in one block: block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,  # elements copied per iteration (a power of two)
    DTYPE: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    base = tl.load(cache_ptrs + cache).to(tl.pointer_type(DTYPE))
    src = tl.load(block_mapping_ptr + 2 * pair) * block_stride
    dst = tl.load(block_mapping_ptr + 2 * pair + 1) * block_stride
    for i in range(0, BLOCK_NUMEL, CHUNK):
        offs = i + tl.arange(0, CHUNK)
        m = offs < BLOCK_NUMEL
        x = tl.load(base + src + offs, mask=m)
        tl.store(base + dst + offs, x, mask=m)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    if block_mapping.numel() == 0:
        return
    caches = [*key_caches, *value_caches]
    first = caches[0]
    if not all(c[0].is_contiguous() and c.dtype == first.dtype and c.shape == first.shape
               and c.stride() == first.stride() for c in caches):
        raise KernelInputError("copy_blocks needs caches of one shape, dtype and stride, each block contiguous")
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()
    numel = first[0].numel()
    _copy_blocks_kernel[(mapping.shape[0], len(caches))](
        ptrs, mapping, first.stride(0), BLOCK_NUMEL=numel, CHUNK=min(1024, triton.next_power_of_2(numel)),
        DTYPE=_TL_DTYPES[first.dtype],
    )
