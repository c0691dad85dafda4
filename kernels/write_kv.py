"""Triton write_kv: scatter the new K/V rows into the paged cache; a negative slot is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from folio.kernels.errors import KernelInputError


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, slot = block * block_size + offset, < 0 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_P)[:, None]
        d = tl.arange(0, HEAD_DIM_P)[None, :]
        m = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=m)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=m)
        tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
                 k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
                 v.to(v_cache_ptr.dtype.element_ty), mask=m)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise KernelInputError("write_kv needs key and value contiguous along head_dim")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
