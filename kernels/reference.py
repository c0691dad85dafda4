"""Pure-torch reference ops: the oracle for the Triton and C++ kernels, and the CPU path
where no C++ compiler is found.

Cache layout, one pair of tensors per layer (see ../shared/DESIGN.md):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Each block is contiguous; the blocks need not be: the engine's layers are strided views
of one block-major tensor [num_blocks, layers, k|v, block_size, kv_heads, head_dim].

    slot = block_id * block_size + offset        (flat index into the first two dims)

    block_tables[s] = [b0, b1, b2, ...]           logical block j of sequence s lives in
                                                  physical block block_tables[s][j]

Every op here works on whole batches: no Python loop over decode sequences.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from folio.kernels.attention_plan import AttentionPlan, kv_bytes_per_token, plan_attention
from folio.kernels.errors import KernelInputError


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int, negative = padding (skipped)
) -> None:
    """Scatter new K/V rows into the paged cache at `slot_mapping`."""
    slot_mapping = slot_mapping.to(torch.long)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    k_rows, k_idx = _token_rows(k_cache, slot_mapping)
    v_rows, v_idx = _token_rows(v_cache, slot_mapping)
    k_rows.index_copy_(0, k_idx, key.to(k_cache.dtype))
    v_rows.index_copy_(0, v_idx, value.to(v_cache.dtype))


def _token_rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [rows, num_kv_heads, head_dim] view of `cache`, the row of each slot). Contiguous: the
    flat view, row = slot. Strided blocks (block-major cache): row r of a view whose rows step
    through the underlying tensor, block b's tokens at rows b * stride + offset (the rows
    in between belong to other layers and are never indexed)."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    if cache.is_contiguous():
        return cache.view(num_blocks * block_size, *cache.shape[2:]), slots
    if not (cache[0].is_contiguous() and cache.stride(0) % cache.stride(1) == 0):
        raise KernelInputError("the KV cache's blocks must each be contiguous, a whole number of rows apart")
    step = cache.stride(0) // cache.stride(1)  # rows from one block's start to the next's
    rows = cache.as_strided(((num_blocks - 1) * step + block_size, *cache.shape[2:]), cache.stride()[1:])
    return rows, slots + (slots // block_size) * (step - block_size)


# Gathers go into scratch buffers that live as long as the thread, one pair per dtype and
# device: a fresh multi-MiB tensor per gather comes from mmap and page-faults on first
# touch. Measured per layer (batch 64 x ~190 tokens): 1.6 ms with the reused buffers,
# 1.7-4.3 ms with fresh ones (glibc's mmap threshold drifts between runs). Per thread,
# because in-process workers step their engines on threads of their own.
_scratch = threading.local()


def _gather(cache: torch.Tensor, blocks: torch.Tensor, which: int) -> torch.Tensor:
    """cache.index_select(0, blocks) into this thread's scratch buffer `which` (0: K, 1: V).
    The result is valid until the next gather into the same buffer."""
    numel = blocks.shape[0] * cache[0].numel()
    key = (cache.dtype, cache.device, which)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = bufs[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
    return torch.index_select(cache, 0, blocks, out=buf[:numel].view(blocks.shape[0], *cache.shape[1:]))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: new tokens of all sequences, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs]: context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]: cumulative new-token counts
    scale: float,
    plan: AttentionPlan | None = None,  # from plan_attention (optional: derived if absent)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] to write into (optional)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], dtype of q
    """Causal attention of the packed new tokens over their paged context (fp32 accumulation).

    New token t of sequence s sits at position seq_lens[s] - q_len_s + t and sees
    positions <= its own. Sequences with one new token (decode) are computed together,
    in chunks; longer queries (prefill, chunked prefill) one sequence each. The
    arithmetic is torch's fused scaled_dot_product_attention on the gathered context.
    """
    num_kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    if plan is None or plan.decode_rows is not None:  # (a plan for the C++ kernel has no decode chunks)
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size, kv_bytes_per_token(k_cache))
    out = torch.empty_like(q) if out is None else out
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    for c in plan.decode:
        n, T = c.rows.shape[0], c.num_blocks * block_size
        k = _gather(k_cache, c.blocks, 0).view(n, T, num_kv_heads, head_dim).transpose(1, 2)  # [n, KVH, T, D]
        v = _gather(v_cache, c.blocks, 1).view(n, T, num_kv_heads, head_dim).transpose(1, 2)
        # GQA folded into the query axis: the `group` query heads of a KV head (heads h = j * group + g,
        # as transformers' repeat_kv orders them) are `group` queries of one attention over that KV
        # head's context, at one position, so one mask serves them all: no K/V repeated per head, and
        # small matrix products instead of vector ones.
        qg = q.index_select(0, c.rows).view(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=c.mask, scale=scale)  # [n, KVH, group, D]
        out.index_copy_(0, c.rows, o.reshape(n, num_heads, head_dim))
    for p in plan.prefill:
        nb = p.blocks.shape[0]
        k = _gather(k_cache, p.blocks, 0).view(1, nb * block_size, num_kv_heads, head_dim)[:, : p.ctx]
        v = _gather(v_cache, p.blocks, 1).view(1, nb * block_size, num_kv_heads, head_dim)[:, : p.ctx]
        qs = q[p.start : p.end].transpose(0, 1)[None]  # [1, H, q_len, D]
        o = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2), attn_mask=p.mask,
                                           is_causal=p.mask is None, scale=scale, enable_gqa=True)
        out[p.start : p.end] = o[0].transpose(0, 1)
    for b in plan.prefill_batches:  # fresh prompts of one length: one causal SDPA over the batch
        nb = b.blocks.shape[0] // b.n
        k = _gather(k_cache, b.blocks, 0).view(b.n, nb * block_size, num_kv_heads, head_dim)[:, : b.q_len]
        v = _gather(v_cache, b.blocks, 1).view(b.n, nb * block_size, num_kv_heads, head_dim)[:, : b.q_len]
        qs = q.index_select(0, b.rows).view(b.n, b.q_len, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
                                           enable_gqa=True)
        out.index_copy_(0, b.rows, o.transpose(1, 2).reshape(b.n * b.q_len, num_heads, head_dim))
    return out


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor],  # per layer, same shape
    block_mapping: torch.Tensor,  # [num_pairs, 2] int (src, dst)
) -> None:
    """Copy whole blocks (copy-on-write) in every layer."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(torch.long).to(key_caches[0].device)
    dst = block_mapping[:, 1].to(torch.long).to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(
    src: torch.Tensor,  # a cache on one device: [num_src_blocks, ...] (block-major: all layers of a block)
    dst: torch.Tensor,  # the same cache layout on the other device
    block_mapping: torch.Tensor | list[tuple[int, int]],  # [num_pairs, 2] int (src block, dst block)
    src_blocks: list[torch.Tensor] | None = None,  # [src[i] for each block i], made once by the caller
    dst_blocks: list[torch.Tensor] | None = None,  # [dst[i] for each block i]
) -> None:
    """Copy blocks between devices (device <-> host), every layer in one call.

    Pairs are coalesced into runs that are consecutive on both sides, and each run
    is one slice copy: with the engine's block-major cache, one contiguous memcpy
    (asynchronous from pinned memory) of all layers' K and V. No gather into a
    temporary, so the bytes move once. All runs go to torch in one `_foreach_copy_`.
    Python's share is the slicing (~1 us a view; a step's swap has dozens): a one-block
    run uses the caller's prebuilt per-block views when given (the engine's runner
    keeps them). Measured on 12 one-block runs: 44 us of overhead per call sliced one
    by one, 7 us with the prebuilt views.
    """
    pairs = block_mapping.tolist() if isinstance(block_mapping, torch.Tensor) else list(block_mapping)
    if not pairs:
        return
    pairs.sort()
    runs: list[list[int]] = []  # [src start, dst start, length]
    for s, d in pairs:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    if src.is_contiguous() and dst.is_contiguous():
        src, dst = src.view(src.shape[0], -1), dst.view(dst.shape[0], -1)
    prebuilt = src_blocks is not None and dst_blocks is not None
    srcs, dsts = [], []
    for s, d, n in runs:
        if n == 1 and prebuilt:
            srcs.append(src_blocks[s])
            dsts.append(dst_blocks[d])
        else:
            srcs.append(src[s : s + n])
            dsts.append(dst[d : d + n])
    torch._foreach_copy_(dsts, srcs, non_blocking=True)


# The forward's small ops, as transformers computes them (the CPU's fused versions: cpu_ops.py)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32, scale in the input dtype (LlamaRMSNorm)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (h + r, rms_norm(h + r))."""
    h = h + r
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up = [gate | up] on the last dim (the fused gate/up projection's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
