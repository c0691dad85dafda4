"""Triton paged attention: one kernel for the whole batch (decode, chunked prefill, prefill).

Program (seq, kv_head, tile x split) handles BLOCK_M rows of that sequence's new tokens for
all GROUP query heads that read this kv head (grouped-query attention):

    row r  ->  new token r // GROUP,  query head kv_head * GROUP + r % GROUP

and walks the context (its split's range of it) in BLOCK_N-token tiles: 64 for a decode tile,
which on an H200 ran 1.1-1.7x faster than tiles of the block size (16). Each token of a tile
finds its physical block through the block table, so any block size works with any tile:

    pos -> block_tables[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

Softmax is online (running max and sum), accumulation in float32.

Split context (flash-decoding): a decode batch of few sequences gives too few programs to fill
a GPU (batch 1 x 8 KV heads = 8 programs for 132 SMs read 50 GB/s on an H200). Then each
program takes one of NUM_SPLITS contiguous ranges of the context and stores its unnormalised
partial result (running max, sum, accumulator) to a float32 scratch; a second kernel merges
the splits of each (token, head) row. A range that a row cannot see (causal, or past the
end) leaves max -inf and sum 0, which the merge weighs 0.
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
    part_m_ptr, part_l_ptr, part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM_P)] float32
    chunk,  # context tokens per split, a multiple of BLOCK_N
    NUM_SPLITS: tl.constexpr,  # 1: no split, the output normalised and stored here
):
    seq, kvh = tl.program_id(0), tl.program_id(1)
    tile, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
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
        lo, hi = split * chunk, tl.minimum(kv_end, split * chunk + chunk)  # this program's context range
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < hi
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
            # a row that sees nothing yet (a split before its first visible token) keeps max -inf:
            # exp against 0 there, not against -inf (which would give exp(nan))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + blk[:, None].to(tl.int64) * stride_vb + off[:, None] * stride_vs
                        + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        _finish_rows(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, (q_start + tok).to(tl.int64),
                     head, d, row_ok, d_ok, split, GROUP * tl.num_programs(1), stride_ot, stride_oh, HEAD_DIM_P,
                     NUM_SPLITS)


@triton.jit
def _finish_rows(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, m_i, l_i, acc, token, head, d, row_ok, d_ok,
                 split, num_heads, stride_ot, stride_oh, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A tile's rows done: normalised into the output, or (a split) stored partial for the merge."""
    if NUM_SPLITS > 1:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + d[None, :], acc, mask=row_ok[:, None])
    else:
        acc = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
):
    """One (token, head) row: the splits' partial softmaxes rescaled to their common max."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = t.to(tl.int64) * tl.num_programs(1) + h
    sp = tl.arange(0, SPLITS_P)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, HEAD_DIM_P)
    m = tl.load(part_m_ptr + row * NUM_SPLITS + sp, mask=sp_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + row * NUM_SPLITS + sp, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + sp)[:, None] * HEAD_DIM_P + d[None, :], mask=sp_ok[:, None],
                  other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - m_max)  # 0 for a range the row saw nothing of (max -inf); split 0 always sees token 0
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


_SM_COUNT: dict[int, int] = {}
SPLIT_MIN_CONTEXT = 4096  # below it a split never paid on an H200: two launches cost more than it saves
MIN_SPLIT_TOKENS = 512  # no range shorter than this
MAX_SPLITS = 32


def num_splits_for(sm_count: int, num_programs: int, max_context: int, tiles: int) -> int:
    """How many context ranges each program's work is split into: enough for ~8 programs per SM
    when the batch gives fewer (a decode batch of few sequences), never a range under
    MIN_SPLIT_TOKENS; 1 for batches with several row tiles (prefill fills the GPU by itself) and
    for contexts under SPLIT_MIN_CONTEXT. From `kernels_gpu.py --split-sweep` on an H200
    (results/kernels_gpu_split_sweep_2026-12-04.json): at contexts <= 2,048 every split was
    within the launch noise of none or slower; at 8,192 the best was 16 for batch 1, 4-8 for
    batch 8-64."""
    if tiles > 1 or max_context < SPLIT_MIN_CONTEXT:
        return 1
    want = -(-8 * sm_count // max(1, num_programs))
    return max(1, min(MAX_SPLITS, want, max_context // MIN_SPLIT_TOKENS))


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (0 off CUDA: no split)."""
    if device.type != "cuda":
        return 0
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    plan=None,  # an AttentionPlan; only its max_query_len and max_seq_len are used here
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] to write into (optional)
    num_splits: int | None = None,  # context ranges per program; None: num_splits_for (1 off CUDA)
    block_n: int | None = None,  # context tokens per iteration; None: 64 for decode, else by block size
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
    tiles = triton.cdiv(max_q * group, block_m)
    if block_n is None:  # a decode tile of 16 rows takes 64 tokens a step; prefill tiles keep registers
        block_n = 64 if tiles == 1 else max(16, min(64, block_size))
    max_ctx = plan.max_seq_len if plan is not None else None
    if num_splits is None:
        if max_ctx is None and q.device.type == "cuda" and tiles == 1:
            max_ctx = int(seq_lens.max())
        num_splits = num_splits_for(sm_count(q.device), num_seqs * num_kv_heads * tiles, max_ctx or 0, tiles)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    chunk, parts = 1 << 30, (out, out, out)  # unused without a split (a dead branch of the kernel)
    if num_splits > 1:
        max_ctx = int(seq_lens.max()) if max_ctx is None else max_ctx
        chunk = triton.cdiv(triton.cdiv(max_ctx, num_splits), block_n) * block_n
        f32 = dict(dtype=torch.float32, device=q.device)
        parts = (torch.empty(num_tokens, num_heads, num_splits, **f32),
                 torch.empty(num_tokens, num_heads, num_splits, **f32),
                 torch.empty(num_tokens, num_heads, num_splits, head_dim_p, **f32))
    grid = (num_seqs, num_kv_heads, tiles * num_splits)
    q = q if q.stride(-1) == 1 else q.contiguous()
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        part_m_ptr=parts[0], part_l_ptr=parts[1], part_acc_ptr=parts[2], chunk=chunk, NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, *parts, out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits))
    return out
