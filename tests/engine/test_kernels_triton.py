"""Triton kernels against their torch references (on CPU under TRITON_INTERPRET=1).

Shapes stay tiny: every kernel program is interpreted in Python.
"""

from __future__ import annotations

import pytest
import torch

from folio.kernels import reference
from folio.kernels.copy_blocks import copy_blocks as triton_copy_blocks
from folio.kernels.paged_attention import paged_attention as triton_paged_attention
from folio.kernels.write_kv import write_kv as triton_write_kv
from test_kernels_reference import block_major, dense_reference, make_case

# (gqa ratio, block size, head dim, dtype): every value of each axis at least once, both dtypes each
CASES = [
    (1, 8, 64, torch.float32), (2, 16, 80, torch.float16), (4, 32, 96, torch.float32),
    (8, 64, 128, torch.float16), (2, 8, 128, torch.float32), (4, 16, 64, torch.float16),
    (8, 32, 80, torch.float32), (1, 64, 96, torch.float16),
]


@pytest.mark.parametrize("gqa,block_size,head_dim,dtype", CASES)
def test_paged_attention_matches_reference(gqa, block_size, head_dim, dtype):
    gen = torch.Generator().manual_seed(gqa * 7 + block_size + head_dim)
    # decode, chunked prefill after cached context, full prefill; lengths ending mid-block
    q_lens = [1, 5, 9, 1]
    ctx_lens = [block_size + 3, 2 * block_size + 1, 9, 1]
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx_lens, 2 * gqa, 2, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    poisoned = torch.full_like(q, float("nan"))
    out = triton_paged_attention(q, kc, vc, tables, lens, qsl, scale, out=poisoned)
    assert out.data_ptr() == poisoned.data_ptr() and not out.isnan().any(), "an output element was not written"
    expected = reference.paged_attention(q, kc, vc, tables, lens, qsl, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), dense_reference(q, ks, vs, q_lens, ctx_lens, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    kc = torch.full((5, 8, 2, 80), float("nan"), dtype=dtype)
    vc = kc.clone()
    qkv = torch.randn(6, 3, 2, 80, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # non-contiguous views, as the model passes them
    slots = torch.tensor([0, 39, -1, 17, 8, -5])
    triton_write_kv(key, value, kc, vc, slots)
    rk, rv = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    reference.write_kv(key, value, rk, rv, slots)
    torch.testing.assert_close(kc, rk, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(vc, rv, equal_nan=True, atol=0, rtol=0)
    assert kc.view(40, 2, 80).isnan().all(dim=(1, 2)).sum() == 40 - 4  # only the 4 real slots written


def test_copy_blocks_all_layers_one_launch():
    gen = torch.Generator().manual_seed(2)
    ks = [torch.randn(6, 4, 2, 16, generator=gen) for _ in range(3)]
    vs = [torch.randn(6, 4, 2, 16, generator=gen) for _ in range(3)]
    for c in (*ks, *vs):
        c[[3, 5]] = float("nan")  # destinations poisoned
    rk, rv = [k.clone() for k in ks], [v.clone() for v in vs]
    mapping = torch.tensor([[0, 3], [2, 5]])
    triton_copy_blocks(ks, vs, mapping)
    reference.copy_blocks(rk, rv, mapping)
    for a, b in zip((*ks, *vs), (*rk, *rv)):
        assert torch.equal(a, b)


def test_kernels_on_block_major_views():
    """The engine's layers are strided views of one block-major tensor: every kernel steps by
    the block stride (the other layers are NaN, so a wrong step shows)."""
    gen = torch.Generator().manual_seed(5)
    q_lens, ctx_lens = [1, 5, 1], [19, 11, 1]
    q, kc, vc, tables, lens, qsl, _, _ = make_case(gen, q_lens, ctx_lens, 4, 2, 16, 8, torch.float32)
    k_view, v_view, big = block_major(kc, vc)
    out = triton_paged_attention(q, k_view, v_view, tables, lens, qsl, 0.25)
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, tables, lens, qsl, 0.25),
                               atol=1e-5, rtol=1e-5)
    key = torch.randn(3, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 2 * 8 + 7])
    triton_write_kv(key, -key, k_view, v_view, slots)
    reference.write_kv(key, -key, kc, vc, slots)
    triton_copy_blocks([k_view], [v_view], torch.tensor([[1, 0], [2, 4]]))
    reference.copy_blocks([kc], [vc], torch.tensor([[1, 0], [2, 4]]))
    assert torch.equal(k_view, kc) and torch.equal(v_view, vc)
    assert big[:, [0, 2]].isnan().all(), "another layer was written"


def test_engine_on_triton_backend_matches_torch_backend(model_dirs, monkeypatch):
    from folio.worker import LLM, SamplingParams

    prompts = ["def f(x):", "import os\nimport sys\n", "x = 1"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", "torch")
    want = [o.token_ids for o in LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=64).generate(prompts, params)]
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", "triton")
    llm = LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=64, max_num_batched_tokens=12)
    assert llm.engine.runner.model.ops.name == "triton"
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want


def test_launchers_raise_a_typed_error_on_layouts_they_cannot_take():
    """Inputs a launcher cannot take: KernelInputError (a ValueError), never an assert
    (which `python -O` would strip, letting the kernel read the wrong memory)."""
    from folio.kernels.errors import KernelInputError

    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key = torch.randn(3, 2, 32)[:, :, ::2]  # head_dim strided
    with pytest.raises(KernelInputError, match="head_dim"):
        triton_write_kv(key, key.clone(), k_cache, v_cache, torch.tensor([0, 1, 2]))
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(KernelInputError, match="one shape"):
        triton_copy_blocks([k_cache], [torch.zeros(4, 8, 2, 8)], mapping)
    with pytest.raises(KernelInputError, match="one shape"):
        triton_copy_blocks([k_cache], [v_cache.double()], mapping)
    torn = torch.zeros(4, 8, 2, 32)[..., ::2]  # no block is contiguous
    with pytest.raises(KernelInputError, match="contiguous"):
        reference.write_kv(torch.randn(3, 2, 16), torch.randn(3, 2, 16), torn, torn.clone(), torch.tensor([0, 1, 2]))
    assert issubclass(KernelInputError, ValueError)


@pytest.mark.parametrize("splits,block_n,gqa,block_size,dtype", [
    (2, 16, 2, 8, torch.float32), (3, 16, 4, 16, torch.float16), (5, 32, 1, 8, torch.float32),
    (4, 64, 2, 32, torch.float16)])
def test_split_context_matches_reference(splits, block_n, gqa, block_size, dtype):
    """Flash-decoding's split: each program takes one context range and a second kernel merges
    them. Rows that see nothing of a range (causal chunked prefill, a short sequence among long
    ones, a range past every end) must weigh 0 in the merge, never NaN."""
    gen = torch.Generator().manual_seed(splits * 31 + block_n)
    q_lens = [1, 4, 1, 1]
    ctx_lens = [5 * block_size + 3, 3 * block_size + 2, 1, 2 * block_size]
    chunk = -(-(-(-ctx_lens[0] // splits)) // block_n) * block_n  # the launcher's range length
    q_lens.append(5)  # a chunk of prompt whose first rows end before the second range starts
    ctx_lens.append(chunk + 2)
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx_lens, 2 * gqa, 2, 32, block_size, dtype)
    scale = 32 ** -0.5
    out = triton_paged_attention(q, kc, vc, tables, lens, qsl, scale, out=torch.full_like(q, float("nan")),
                                 num_splits=splits, block_n=block_n)
    assert not out.isnan().any(), "a row was not merged"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, tables, lens, qsl, scale), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), dense_reference(q, ks, vs, q_lens, ctx_lens, scale), atol=tol, rtol=tol)


def test_split_policy():
    from folio.kernels.paged_attention import MAX_SPLITS, MIN_SPLIT_TOKENS, SPLIT_MIN_CONTEXT, num_splits_for

    assert num_splits_for(132, 8, 32768, 1) == MAX_SPLITS  # batch 1, 8 KV heads, long context
    assert num_splits_for(132, 8, 8192, 1) == 8192 // MIN_SPLIT_TOKENS  # no range under the minimum
    assert num_splits_for(132, 8, SPLIT_MIN_CONTEXT - 1, 1) == 1  # short contexts: one launch is cheaper
    assert num_splits_for(132, 2048, 32768, 1) == 1  # batch 256 x 8 KV heads already fills the GPU
    assert num_splits_for(132, 8, 32768, 2) == 1  # several row tiles: a prefill, no split
    assert num_splits_for(0, 8, 32768, 1) == 1  # no SMs (CPU)
    for programs in range(1, 3000, 7):
        n = num_splits_for(132, programs, 8192, 1)
        assert 1 <= n <= MAX_SPLITS and (n == 1 or programs * (n - 1) < 8 * 132)


@pytest.mark.parametrize("rows,width,pad", [(1, 64, 0), (5, 576, 0), (3, 100, 28), (7, 1000, 24)])
def test_fused_small_ops_match_the_reference_chains(rows, width, pad):
    """triton_ops' norms and SiLU*up against reference.py's torch chains: float16 within two
    steps of the dtype (a row's squares summed in another order), the residual add exact and
    written into h; rows that are views with a wider stride; float32 goes to the chains as is."""
    from folio.kernels import triton_ops

    gen = torch.Generator().manual_seed(rows * 1000 + width)
    for scale in (1.0, 30.0, 1e-3):
        base = (torch.randn(rows, width + pad, generator=gen) * scale).half()
        x = base[:, :width]  # a view: row stride width + pad
        r = (torch.randn(rows, width, generator=gen) * scale).half()
        w = (torch.randn(width, generator=gen) * 0.5 + 1).half()
        tol = dict(atol=2.0 ** -23, rtol=2 * 2.0 ** -10)  # two float16 steps (or two subnormal ones)
        torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **tol)
        want_h, want_y = reference.add_rms_norm(x.clone(), r, w, 1e-6)
        h = x.clone()
        got_h, got_y = triton_ops.add_rms_norm(h, r, w, 1e-6)
        assert got_h.data_ptr() == h.data_ptr() and torch.equal(got_h, want_h), "the sum, rounded as torch's add"
        torch.testing.assert_close(got_y, want_y, **tol)
        gu = (torch.randn(rows, 2 * width, generator=gen) * scale * 4).half()
        torch.testing.assert_close(triton_ops.silu_mul(gu), reference.silu_mul(gu), **tol)
    x32 = torch.randn(rows, width, generator=gen)
    w32 = torch.randn(width, generator=gen)
    assert torch.equal(triton_ops.rms_norm(x32, w32, 1e-6), reference.rms_norm(x32, w32, 1e-6))
    assert torch.equal(triton_ops.silu_mul(torch.cat([x32, x32], 1)), reference.silu_mul(torch.cat([x32, x32], 1)))


def test_engine_in_float16_on_triton_backend_uses_the_fused_ops(model_dirs, monkeypatch):
    """A 16-bit model on the Triton backend runs its norms, SiLU*up and rotary + KV write through
    triton_ops (one launch each on a GPU) and stays close to the torch backend's chains: the same greedy tokens
    until a step whose top-2 logits the two orders of summation could swap."""
    from folio.kernels import triton_ops
    from folio.worker import LLM, SamplingParams

    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", backend)
        llm = LLM(model_dirs["llama"], dtype="float16", block_size=8, num_kv_blocks=64)
        ops = llm.engine.runner.model.ops
        runs[backend] = llm.generate(["def f(x):", "import os\n"], params)
    assert (ops.rms_norm, ops.add_rms_norm, ops.silu_mul, ops.rope_write_kv) == (
        triton_ops.rms_norm, triton_ops.add_rms_norm, triton_ops.silu_mul, triton_ops.rope_write_kv)
    for a, b in zip(runs["torch"], runs["triton"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:  # allowed only where the reference's top two were within float16's reach
                top = sorted(a.outputs[0].logprobs[i].values(), reverse=True)[:2]
                assert top[0] - top[1] < 1e-2, (i, ta, tb)
                break


def test_fused_small_ops_fall_back_to_the_chains_when_a_launch_fails(monkeypatch):
    """A kernel a compiler rejects must not fail the step: that call and every later one run
    torch's chains (and h is left as it was for the chain's add)."""
    from folio.kernels import triton_ops

    class Broken:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("no such instruction")
            return launch

    monkeypatch.setattr(triton_ops, "_rms_norm_kernel", Broken())
    monkeypatch.setattr(triton_ops, "_silu_mul_kernel", Broken())
    monkeypatch.setattr(triton_ops, "_broken", [])
    gen = torch.Generator().manual_seed(3)
    x, r = (torch.randn(3, 64, generator=gen).half() for _ in range(2))
    w = torch.randn(64, generator=gen).half()
    want_h, want_y = reference.add_rms_norm(x.clone(), r, w, 1e-6)
    got_h, got_y = triton_ops.add_rms_norm(x.clone(), r, w, 1e-6)
    assert torch.equal(got_h, want_h) and torch.equal(got_y, want_y)
    assert triton_ops._broken == ["RuntimeError"]
    assert torch.equal(triton_ops.silu_mul(torch.cat([x, r], 1)), reference.silu_mul(torch.cat([x, r], 1)))
    assert torch.equal(triton_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("nh,nkv,D,block_size,layout", [(4, 2, 16, 8, "block_major"), (3, 1, 64, 16, "flat"),
                                                         (6, 3, 32, 4, "block_major")])
def test_fused_rope_write_kv_is_the_chain_bit_for_bit(nh, nkv, D, block_size, layout):
    """triton_ops.rope_write_kv against RotaryEmbedding.rotate + write_kv in float16: q and both
    caches equal to the bit, a negative slot written nowhere; float32 and partial rotations
    are left to the chain (None)."""
    from folio.kernels import triton_ops
    from folio.worker.models.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(nh * 100 + D)
    T, blocks = 7, 6
    rope = RotaryEmbedding(D, {"rope_theta": 10000.0}, 4096, 512, torch.float16, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.randint(0, 512, (T,), generator=gen))
    qkv = (torch.randn(T, (nh + 2 * nkv) * D, generator=gen) * 3).half()
    slots = torch.randperm(blocks * block_size, generator=gen)[:T]
    slots[2] = -1
    if layout == "block_major":
        big = torch.full((blocks, 2, 2, block_size, nkv, D), float("nan")).half()
        kc, vc = big[:, 1, 0], big[:, 1, 1]
    else:
        kc, vc = (torch.full((blocks, block_size, nkv, D), float("nan")).half() for _ in range(2))
    rk, rv = kc.clone(), vc.clone()
    q = triton_ops.rope_write_kv(qkv, cos, sin, nh, nkv, kc, vc, slots)
    qk = rope.rotate(qkv[:, :(nh + nkv) * D].view(T, nh + nkv, D), cos, sin)
    want_q, k = qk.split([nh, nkv], dim=1)
    reference.write_kv(k, qkv[:, (nh + nkv) * D:].view(T, nkv, D), rk, rv, slots)
    assert torch.equal(q, want_q)
    torch.testing.assert_close(kc, rk, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(vc, rv, equal_nan=True, atol=0, rtol=0)
    assert kc.isnan().flatten(0, 1).all(-1).all(-1).sum() == blocks * block_size - (T - 1)  # 6 slots written
    assert triton_ops.rope_write_kv(qkv.float(), cos.float(), sin.float(), nh, nkv, kc.float(), vc.float(),
                                    slots) is None
    assert triton_ops.rope_write_kv(qkv, cos[..., : D // 2], sin[..., : D // 2], nh, nkv, kc, vc, slots) is None
