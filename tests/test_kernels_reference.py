"""Torch reference ops against plain dense attention in float64, on random paged layouts."""

from __future__ import annotations

import pytest
import torch

from folio.kernels import copy_blocks, paged_attention, swap_blocks, write_kv


def dense_reference(q, ks, vs, q_lens, ctx_lens, scale):
    """Per sequence, causal attention in float64 over the full context (no paging)."""
    outs = []
    H = q.shape[1]
    start = 0
    for k, v, ql, ctx in zip(ks, vs, q_lens, ctx_lens):
        qs = q[start : start + ql].double()
        group = H // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        qpos = torch.arange(ctx - ql, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += ql
    return torch.cat(outs)


def make_case(gen, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Random contexts scattered over random, non-contiguous blocks of a shared pool."""
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    tables = torch.zeros(len(ctx_lens), max_blocks + 2, dtype=torch.int32)  # extra padding columns
    ks, vs = [], []
    for s, ctx in enumerate(ctx_lens):
        nb = -(-ctx // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        ks.append(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx])
        vs.append(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx])
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32), qsl, ks, vs


@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(1, 16), (8, 64), (16, 80), (32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_mixed_batch(gqa, block_size, head_dim, dtype):
    gen = torch.Generator().manual_seed(gqa * 1000 + block_size * 10 + head_dim)
    # decode (1 new token), chunked prefill (chunk after cached context), full prefill,
    # lengths ending mid-block and on block boundaries
    q_lens = [1, 7, 1, 13, 1, 5]
    ctx_lens = [37, 29, 1, 13, 2 * block_size, 5]
    num_kv_heads = 2
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx_lens, num_kv_heads * gqa,
                                                     num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = paged_attention(q, kc, vc, tables, lens, qsl, scale)
    ref = dense_reference(q, ks, vs, q_lens, ctx_lens, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_write_kv_skips_negative_slots():
    kc = torch.full((4, 2, 1, 3), -7.0)
    vc = torch.full((4, 2, 1, 3), -7.0)
    key = torch.arange(9.0).view(3, 1, 3)
    value = -key
    write_kv(key, value, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(8, 1, 3)[5], key[0]) and torch.equal(kc.view(8, 1, 3)[0], key[2])
    assert torch.equal(vc.view(8, 1, 3)[5], value[0])
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert (kc.view(8, 1, 3)[untouched] == -7).all() and (vc.view(8, 1, 3)[untouched] == -7).all()


def test_copy_blocks_all_layers():
    ks = [torch.randn(6, 4, 2, 8) for _ in range(3)]
    vs = [torch.randn(6, 4, 2, 8) for _ in range(3)]
    before_k = [k.clone() for k in ks]
    copy_blocks(ks, vs, torch.tensor([[0, 3], [2, 5]]))
    for k, b in zip(ks, before_k):
        assert torch.equal(k[3], b[0]) and torch.equal(k[5], b[2]) and torch.equal(k[:3], b[:3])
    assert all(torch.equal(v[3], v[0]) for v in vs)


def test_swap_blocks_batched():
    dev = torch.randn(5, 4, 2, 8)
    host = torch.zeros(7, 4, 2, 8)
    swap_blocks(dev, host, torch.tensor([[1, 6], [4, 0]]))
    assert torch.equal(host[6], dev[1]) and torch.equal(host[0], dev[4])
    assert (host[1:6] == 0).all()
