"""Torch reference ops against plain dense attention in float64, on random paged layouts."""

from __future__ import annotations

import pytest
import torch

from folio.kernels import copy_blocks, paged_attention, plan_attention, swap_blocks, write_kv


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


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("strided", [False, True])
def test_fresh_prompts_of_one_length_are_attended_as_a_batch(block_size, strided):
    """Prompts with nothing cached and the same length go through one SDPA call (PrefillBatch),
    between decodes, a chunked prefill and a prompt of another length: each row equals dense
    attention, and equals the same prompt attended alone to the bit."""
    gen = torch.Generator().manual_seed(block_size)
    q_lens = [11, 1, 11, 7, 11, 3]
    ctx_lens = [11, 20, 11, 7, 11, 9]
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx_lens, 6, 2, 32, block_size, torch.float32)
    if strided:
        kc, vc, _ = block_major(kc, vc)
    plan = plan_attention(tables, lens, qsl, block_size, 0)
    assert [(b.n, b.q_len) for b in plan.prefill_batches] == [(3, 11)]
    assert sorted(p.end - p.start for p in plan.prefill) == [3, 7]
    out = paged_attention(q, kc, vc, tables, lens, qsl, 0.2, plan=plan)
    torch.testing.assert_close(out.double(), dense_reference(q, ks, vs, q_lens, ctx_lens, 0.2), atol=2e-5, rtol=2e-5)
    for s in (0, 2, 4):  # each batched prompt alone: the same bits
        a, b = int(qsl[s]), int(qsl[s + 1])
        one = paged_attention(q[a:b], kc, vc, tables[s : s + 1], lens[s : s + 1],
                              torch.tensor([0, b - a], dtype=qsl.dtype), 0.2)
        assert torch.equal(one, out[a:b])


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


def block_major(k_cache, v_cache, layers=3, layer=1):
    """The same caches as strided views of layer `layer` of a block-major tensor
    [blocks, layers, k|v, block_size, kv_heads, head_dim] (the engine's layout), every other
    layer NaN: a kernel that steps by a block's size instead of the block stride reads NaN."""
    big = torch.full((k_cache.shape[0], layers, 2, *k_cache.shape[1:]), float("nan"), dtype=k_cache.dtype)
    big[:, layer, 0], big[:, layer, 1] = k_cache, v_cache
    return big[:, layer, 0], big[:, layer, 1], big


def test_block_major_views_attend_like_contiguous_caches():
    gen = torch.Generator().manual_seed(3)
    q_lens, ctx_lens = [1, 7, 1, 5], [37, 29, 1, 5]
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx_lens, 4, 2, 16, 8, torch.float32)
    k_view, v_view, _ = block_major(kc, vc)
    assert not k_view.is_contiguous()
    got = paged_attention(q, k_view, v_view, tables, lens, qsl, 0.25)
    assert torch.equal(got, paged_attention(q, kc, vc, tables, lens, qsl, 0.25))


def test_write_kv_into_block_major_views_touches_only_its_slots():
    kc, vc = torch.zeros(4, 2, 1, 3), torch.zeros(4, 2, 1, 3)
    k_view, v_view, big = block_major(kc, vc)
    key = torch.arange(9.0).view(3, 1, 3) + 1
    slots = torch.tensor([7, -1, 2])
    write_kv(key, -key, k_view, v_view, slots)
    write_kv(key, -key, kc, vc, slots)
    assert torch.equal(k_view, kc) and torch.equal(v_view, vc) and kc.count_nonzero() == 6
    assert big[:, [0, 2]].isnan().all(), "another layer was written"


def test_copy_blocks_on_block_major_views():
    gen = torch.Generator().manual_seed(4)
    ks, vs, bigs = [], [], []
    for layer in range(2):
        k, v, big = block_major(torch.randn(6, 4, 2, 8, generator=gen), torch.randn(6, 4, 2, 8, generator=gen),
                                layers=2, layer=layer)
        ks.append(k), vs.append(v), bigs.append(big)
    copy_blocks(ks, vs, torch.tensor([[0, 3], [2, 5]]))
    for c in (*ks, *vs):
        assert torch.equal(c[3], c[0]) and torch.equal(c[5], c[2]) and not torch.equal(c[1], c[0])


@pytest.mark.parametrize("prebuilt_views", [False, True])
def test_swap_blocks_moves_every_layer_of_a_block_major_cache(prebuilt_views):
    dev = torch.randn(8, 3, 2, 4, 2, 8)  # [blocks, layers, k|v, block_size, kv_heads, head_dim]
    host = torch.zeros(6, 3, 2, 4, 2, 8)
    views = (list(dev.unbind(0)), list(host.unbind(0))) if prebuilt_views else (None, None)
    # runs: 2 -> 4 and 3 -> 5 (one run of two), 4..6 -> 0..2 (a run of three)
    swap_blocks(dev, host, torch.tensor([[5, 1], [2, 4], [4, 0], [6, 2], [3, 5]]), *views)
    for d, h in ((5, 1), (2, 4), (4, 0), (6, 2), (3, 5)):
        assert torch.equal(host[h], dev[d])
    assert (host[3] == 0).all()
    back = torch.zeros_like(dev)
    views = (list(host.unbind(0)), list(back.unbind(0))) if prebuilt_views else (None, None)
    swap_blocks(host, back, [(1, 7), (0, 0)], *views)
    assert torch.equal(back[7], dev[5]) and torch.equal(back[0], dev[4]) and (back[1:7] == 0).all()
