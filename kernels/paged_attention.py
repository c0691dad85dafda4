"""Triton paged attention: one kernel for the whole batch (decode, chunked prefill, prefill).

Program (seq, kv_head, tile) handles BLOCK_M rows of that sequence's new tokens for all
GROUP query heads that read this kv head (grouped-query attention):

    row r  ->  new token r // GROUP,  query head kv_head * GROUP + r % GROUP

and walks the context in BLOCK_N-token tiles. Each token of a tile finds its
physical block through the block table, so any block size works with any tile:

    pos -> block_tables[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

Softmax is online (running max and sum), accumulation in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_M: tl.constexpr,  # rows (token x group head) per program
    BLOCK_N: tl.constexpr,  # context tokens per iteration
    IEEE: tl.constexpr,  # exact float32 products (no TF32)
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_rows = q_len * GROUP
    if tile * BLOCK_M < num_rows:
        ctx = tl.load(seq_lens_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        tok = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        q_pos = ctx - q_len + tok  # position of each row's token
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
                    + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        kv_end = ctx - q_len + last_tok + 1  # no row of this tile sees past this
        for start in range(0, kv_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < kv_end
            blk = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            off = pos % BLOCK_SIZE
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + blk[:, None].to(tl.int64) * stride_kb + off[:, None] * stride_ks
                        + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            # causal; rows past the end see everything (never stored, kept finite)
            visible = pos_ok[None, :] & ((pos[None, :] <= q_pos[:, None]) | ~row_ok[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + blk[:, None].to(tl.int64) * stride_vb + off[:, None] * stride_vs
                        + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
                 + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    plan=None,  # an AttentionPlan; only its max_query_len is used here
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] to write into (optional)
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    if plan is not None and plan.max_query_len is not None:
        max_q = plan.max_query_len
    else:
        max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = 16 if max_q * group <= 16 else 32
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_q * group, block_m))
    q = q if q.stride(-1) == 1 else q.contiguous()
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=max(16, min(64, block_size)),
        IEEE=q.dtype == torch.float32,
    )
    return out
