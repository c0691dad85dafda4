"""The fused CPU ops (kernels/cpu_ops.cpp) against the torch chains they replace (reference.py):
argmax exactly (ties, NaN, infinities, bfloat16 rows); the norms within two bfloat16 steps of
transformers' roundings (its rsqrt may differ in the last float bit, which can move the
normalized row's rounding by one step and w's product by two) or four float32 ones; SiLU within
two bfloat16 steps or six float32 ones (4e-7 relative); in bfloat16 nearly all values equal; the
rotation to the bit in both dtypes; on generated shapes and values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kernels import backend, cpu_attention, cpu_ops, reference

pytestmark = pytest.mark.skipif(cpu_attention.load() is not None, reason="no C++ compiler here")

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e38, -1e38, 1e-40]


@st.composite
def logit_rows(draw):
    rows, n = draw(st.integers(0, 6)), draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31))
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * draw(st.sampled_from([1.0, 1e-3, 50.0]))
    for _ in range(draw(st.integers(0, 6))):  # specials and ties at drawn places
        if rows:
            r, i = draw(st.integers(0, rows - 1)), draw(st.integers(0, n - 1))
            kind = draw(st.sampled_from(["special", "tie", "row"]))
            if kind == "special":
                x[r, i] = draw(st.sampled_from(SPECIAL))
            elif kind == "tie":
                x[r, i] = x[r].max() if not x[r].isnan().any() else 0.0
            else:
                x[r] = draw(st.sampled_from(SPECIAL))
    return x


@settings(max_examples=200, deadline=None, derandomize=True)
@given(logit_rows(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_argmax_rows_is_torch_argmax(x, dtype, strided):
    x = x.to(dtype)
    if strided and x.shape[1] > 1:
        x = x[:, : x.shape[1] // 2 + 1]  # rows not contiguous with each other
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_at_a_vocab_size_and_other_dtypes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 49152, generator=g)
    x[3, 40000] = x[3, 1] = 99.0  # a tie: the first
    x[5, 30000] = float("nan")
    x[7] = float("-inf")
    for t in (x, x.bfloat16(), x.half(), x.t().contiguous().t()):
        assert torch.equal(cpu_ops.argmax_rows(t), t.argmax(dim=-1))


@st.composite
def bf16_case(draw):
    T, n = draw(st.integers(0, 40)), draw(st.sampled_from([1, 7, 64, 576, 1000]))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e20]))  # 1e20: squares overflow float32
    return T, n, draw(st.integers(0, 2**31)), scale


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in steps of the dtype, bfloat16 or float32 (same-sign finite values)."""
    if a.dtype == torch.float32:
        return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    return (ia - ib).abs()


DTYPES = st.sampled_from([torch.bfloat16, torch.float32])
STEPS = {torch.bfloat16: 2, torch.float32: 4}


@settings(max_examples=80, deadline=None, derandomize=True)
@given(bf16_case(), DTYPES)
def test_norms_keep_transformers_roundings(case, dtype):
    T, n, seed, scale = case
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, n, generator=g) * scale).to(dtype)
    r = (torch.randn(T, n, generator=g) * scale).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    got, want = cpu_ops.rms_norm(h, w, eps), reference.rms_norm(h, w, eps)
    assert got.dtype == dtype and got.shape == want.shape
    if got.numel():
        u = _ulps(got, want)
        # bfloat16: one step of the normalized row's rounding, scaled by w: at most two of the
        # output's; float32: rsqrt's own last bits (torch rounds the mean, the sum with eps and
        # the root each once; this op rounds 1 / sqrt once, in double) show too, four at most
        assert u.max().item() <= STEPS[dtype], (got.flatten()[u.argmax()], want.flatten()[u.argmax()])
    h2 = h.clone()
    hs, normed = cpu_ops.add_rms_norm(h2, r, w, eps)
    want_h, want_n = reference.add_rms_norm(h, r, w, eps)
    assert torch.equal(hs, want_h)  # the residual add rounds exactly as torch's
    if normed.numel():
        assert _ulps(normed, want_n).max().item() <= STEPS[dtype]
        if normed.numel() >= 512 and dtype == torch.bfloat16:
            assert (normed != want_n).float().mean().item() < 0.01  # the squares' order rarely shows


@settings(max_examples=80, deadline=None, derandomize=True)
@given(bf16_case(), DTYPES)
def test_silu_mul_keeps_transformers_roundings(case, dtype):
    T, n, seed, scale = case
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(T, 2 * n, generator=g) * scale * 4).to(dtype)
    got, want = cpu_ops.silu_mul(gu), reference.silu_mul(gu)
    assert got.shape == want.shape == (T, n)
    if got.numel():
        # silu(gate) rounded, then times up rounded: two steps at most, as for the norms; values
        # below 1e-30 (gate under -88, where exp's argument is bounded) count as the zero they round near
        tiny = (got.float().abs() < 1e-30) & (want.float().abs() < 1e-30)
        u = torch.where(tiny, 0, _ulps(got, want))
        # float32: torch's silu is within 2 steps of the float64 truth here, this op's within 3-4
        # (glibc's exp, and a division that -ffast-math may take as a product by the reciprocal),
        # so they may be 6 apart (measured: 5), 4e-7 relative
        steps = 2 if dtype == torch.bfloat16 else 6
        assert u.max().item() <= steps, (got.flatten()[u.argmax()], want.flatten()[u.argmax()])
        if got.numel() >= 512 and scale <= 1 and dtype == torch.bfloat16:  # (larger gates reach the tiny values')
            assert (got != want).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_on_every_kind_of_value(dtype):
    """In a full vector of the op's loop and in its tail (AVX-512: its own exp on 16 lanes, a
    masked tail; elsewhere glibc's exp, vectorized by the compiler, and a scalar tail), every
    kind of value comes out as torch's chain has it, within its roundings: NaN, infinities, zeros, exp's
    range edges, huge gates. Gates below -80 give what is under 1e-30 (a zero below -88, where
    torch has a magnitude under 1e-36, or NaN for -inf)."""
    vals = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 20.0, -20.0, 87.9,
            -87.9, 88.1, -88.1, 103.0, -103.0, 105.0, -105.0, 1e20, -1e20, 3e38, -3e38]
    rows = [(v, u) for v in vals for u in (1.0, -3.0, 0.0, float("inf"))]
    gate = torch.tensor([[v] * 17 + [u] * 17 for v, u in rows]).to(dtype)  # 17: a vector, then a tail of 1
    got, want = cpu_ops.silu_mul(gate).float(), reference.silu_mul(gate).float()
    low = gate[:, 0].float() < -80  # silu is under 1e-33 in magnitude there
    tiny = low & gate[:, 17].float().isfinite()  # (times an infinite up: anything)
    assert (got[tiny][:, [0, 16]].abs() < 1e-30).all()
    for col in (0, 16):  # in a full vector, and in the tail
        a, b = got[~low, col], want[~low, col]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        finite = a.isfinite()
        assert torch.equal(a[finite].signbit(), b[finite].signbit())
        steps = 2 if dtype == torch.bfloat16 else 6  # the roundings test_silu_mul_keeps_transformers_roundings allows
        assert _ulps(a[finite].to(dtype).contiguous(), b[finite].to(dtype).contiguous()).max().item() <= steps


def test_float16_mixed_dtypes_and_odd_layouts_take_the_reference():
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    for a, b in ((x.half(), w.half()), (x, w.bfloat16())):
        assert torch.equal(cpu_ops.rms_norm(a, b, 1e-6), reference.rms_norm(a, b, 1e-6))
    gu = torch.randn(4, 128).bfloat16()
    assert torch.equal(cpu_ops.silu_mul(gu.t().contiguous().t()), reference.silu_mul(gu))
    assert torch.equal(cpu_ops.silu_mul(gu.half()), reference.silu_mul(gu.half()))


def test_bad_shapes_are_refused_by_the_op_not_read_out_of_bounds():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="rms_norm w"):
        torch.ops.folio_cpu.rms_norm(x, torch.ones(63).bfloat16(), 1e-6, torch.empty_like(x))
    with pytest.raises(RuntimeError, match="silu_mul"):
        torch.ops.folio_cpu.silu_mul(x, torch.empty(4, 31).bfloat16())
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.folio_cpu.argmax_rows(torch.empty(3, 0))


def test_the_cpp_backend_fuses_and_the_torch_backend_does_not(monkeypatch):
    monkeypatch.delenv("FOLIO_ATTENTION_BACKEND", raising=False)
    ops = backend.get_ops("cpu")
    assert ops.name == "cpp" and ops.rms_norm is cpu_ops.rms_norm and ops.silu_mul is cpu_ops.silu_mul
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", "torch")
    t = backend.get_ops("cpu")
    assert t.rms_norm is reference.rms_norm and t.add_rms_norm is reference.add_rms_norm
    assert dataclasses.replace(ops, rms_norm=reference.rms_norm).rms_norm is reference.rms_norm


@st.composite
def rope_case(draw):
    T = draw(st.integers(1, 24))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    D = draw(st.sampled_from([8, 64, 128]))
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(T // block_size + 1, T // block_size + 4))
    slots = draw(st.permutations(range(num_blocks * block_size)))[:T]
    pads = draw(st.lists(st.integers(0, T - 1), max_size=3))
    slots = [-1 if i in pads else s for i, s in enumerate(slots)]
    return T, heads, kv_heads, D, block_size, num_blocks, slots, draw(st.integers(0, 2**31))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(rope_case(), st.booleans(), DTYPES)
def test_rope_write_kv_is_the_models_chain_to_the_bit(case, block_major, dtype):
    """q, and every cache row, as RotaryEmbedding.rotate + write_kv leave them (padding slots
    unwritten), on the engine's block-major layout or plain caches."""
    from folio.worker.models.rope import RotaryEmbedding

    T, H, KVH, D, bs, nb, slots, seed = case
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(D, {"rope_theta": 10000.0}, 4096, 512, dtype, torch.device("cpu"))
    positions = torch.randint(0, 512, (T,), generator=g)
    cos, sin = rope.cos_sin(positions)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.long)

    def caches():
        if block_major:  # [blocks, layers=2, k|v, block_size, kv_heads, D]: layer 1's views
            big = torch.randn(nb, 2, 2, bs, KVH, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
            return big[:, 1, 0], big[:, 1, 1]
        big = torch.randn(2, nb, bs, KVH, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
        return big[0], big[1]

    k1, v1 = caches()
    q = cpu_ops.rope_write_kv(qkv, cos, sin, H, KVH, k1, v1, slot_mapping)
    k2, v2 = caches()
    qk = rope.rotate(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
    want_q, k = qk.split([H, KVH], dim=1)
    reference.write_kv(k, qkv[:, (H + KVH) * D:].view(T, KVH, D), k2, v2, slot_mapping)
    assert q is not None and torch.equal(q, want_q)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_rope_write_kv_refuses_a_slot_past_the_cache_and_leaves_float16_to_the_chain():
    from folio.kernels.errors import KernelInputError

    qkv = torch.randn(2, 3 * 8).bfloat16()
    cos = torch.ones(2, 1, 8).bfloat16()
    k, v = torch.zeros(2, 4, 1, 8).bfloat16(), torch.zeros(2, 4, 1, 8).bfloat16()
    with pytest.raises(KernelInputError, match="slot 8 outside"):
        cpu_ops.rope_write_kv(qkv, cos, cos, 1, 1, k, v, torch.tensor([0, 8]))
    assert cpu_ops.rope_write_kv(qkv.half(), cos.half(), cos.half(), 1, 1, k.half(), v.half(),
                                 torch.tensor([0, 1])) is None


# ---- sample_rows: the fused filters (top-k, top-p, min-p) and inverse CDF of softmax(x / T) ----
def kept_set(x_row: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """float64 weights of the tokens sampler._filter keeps, unnormalized (e = exp((x - max) / T)),
    tokens ordered by e descending then index ascending: the kernel's definition, in float64."""
    x = x_row.double()
    m = x.max()
    e = torch.where(x == m, torch.ones_like(x), torch.exp((x - m) / t))
    e = torch.where(x == float("-inf"), torch.zeros_like(x), e)
    order = sorted(range(len(e)), key=lambda i: (-float(e[i]), i))
    keep = torch.zeros_like(e, dtype=torch.bool)
    live = [i for i in order if e[i] > 0]
    if top_k > 0:
        live = live[:top_k]
    total = float(sum(e[i] for i in live))
    before = 0.0
    for i in live:
        if top_p < 1.0 and before >= top_p * total:
            break
        keep[i] = True
        before += float(e[i])
    return torch.where(keep & (e >= min_p), e, torch.zeros_like(e))


@st.composite
def sampling_case(draw):
    rows, n = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 63, 64, 65, 300, 3000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, n, generator=g) * draw(st.sampled_from([0.1, 3.0, 20.0]))
    masked = torch.rand(rows, n, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.99]))
    x = x.masked_fill(masked, float("-inf"))
    x[:, draw(st.integers(0, n - 1))] = 1.0  # at least one token left in every row
    if draw(st.booleans()):  # ties: values on a coarse grid
        x = (x * 2).round() / 2
    pick = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=6))
    temps = [draw(st.sampled_from([0.05, 0.7, 1.0, 2.5])) for _ in pick]
    top_ks = [draw(st.sampled_from([0, 0, 1, 2, 7, 50, 5000])) for _ in pick]
    top_ps = [draw(st.sampled_from([1.0, 1.0, 0.95, 0.5, 0.1, 1e-6])) for _ in pick]
    min_ps = [draw(st.sampled_from([0.0, 0.0, 0.05, 0.5])) for _ in pick]
    us = [draw(st.one_of(st.sampled_from([0.0, 0.5, 1 - 2**-53]), st.floats(0, 1, exclude_max=True))) for _ in pick]
    return x, pick, temps, top_ks, top_ps, min_ps, us


def draw_rows(x, pick, temps, top_ks, top_ps, min_ps, us):
    return cpu_ops.sample_rows(x, torch.tensor(pick), torch.tensor(temps), torch.tensor(top_ks),
                               torch.tensor(top_ps), torch.tensor(min_ps), torch.tensor(us, dtype=torch.float64))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(sampling_case(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_sample_rows_is_the_inverse_cdf_of_the_filtered_distribution(case, dtype):
    """The drawn token is kept by the filters (their definition in float64, `kept_set`) and is
    the one whose cumulative kept mass straddles u * total, to float32 rounding."""
    x, pick, temps, top_ks, top_ps, min_ps, us = case
    x = x.to(dtype)
    got = draw_rows(x, pick, temps, top_ks, top_ps, min_ps, us)
    for k, r in enumerate(pick):
        w = kept_set(x[r].float(), temps[k], top_ks[k], top_ps[k], min_ps[k])
        i = int(got[k])
        assert w[i] > 0, (k, i)
        cdf = w.cumsum(0)
        target = us[k] * float(cdf[-1])
        lo = float(cdf[i - 1]) if i else 0.0
        tol = 1e-5 * float(cdf[-1])
        assert lo - tol <= target <= float(cdf[i]) + tol, (k, i, lo, target, float(cdf[i]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), vocab=st.sampled_from([7, 300, 3000]), scale=st.sampled_from([0.3, 3.0, 12.0]),
       t=st.sampled_from([0.5, 1.0, 1.7]), top_k=st.sampled_from([0, 1, 5, 50, 2000]),
       top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.1]))
def test_sample_rows_keeps_what_the_torch_filters_keep(seed, vocab, scale, t, top_k, top_p, min_p):
    """The set the kernel can draw from is _filter's (the torch path's, sorted in float32): with
    u swept over [0, 1), the tokens drawn are those _filter gives a probability, bar tokens at
    the top-p boundary within float32 rounding of it."""
    from folio.worker.sampler import _filter
    from folio.worker.sampling_params import SamplingParams

    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    want = _filter(x, [SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)])[0]
    n = 2000
    us = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).tolist()
    got = draw_rows(x, [0] * n, [t] * n, [top_k] * n, [top_p] * n, [min_p] * n, us)
    share = torch.bincount(got, minlength=vocab).double() / n
    assert float((share - want.double()).abs().max()) <= 2 / n + 1e-4 * (top_p < 1.0)


def test_sample_rows_draws_each_token_with_its_probability():
    """A grid of u over [0, 1) is a quadrature of the distribution: each token's share of the
    draws is its probability to within two grid steps, at a real vocabulary's size."""
    from folio.worker.sampler import _filter
    from folio.worker.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 49152, generator=g) * 4
    n = 4000
    us = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).tolist()
    for r, (t, k, p, m) in enumerate([(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.02), (1.0, 0, 0.9, 0.0), (0.8, 40, 0.95, 0.0)]):
        got = draw_rows(x, [r % 2] * n, [t] * n, [k] * n, [p] * n, [m] * n, us)
        share = torch.bincount(got, minlength=x.shape[1]).double() / n
        want = _filter(x[r % 2:r % 2 + 1], [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)])[0].double()
        assert float((share - want).abs().max()) <= 2 / n + 1e-4, (t, k, p, m)
        assert bool((want[got] > 0).all())


def test_sample_rows_nan_and_masked_rows_and_bad_input():
    x = torch.randn(3, 100)
    x[0, 7] = x[0, 9] = float("nan")
    x[1] = float("-inf")

    def one(r, t=1.0, u=0.5, k=0, p=1.0, m=0.0):
        return torch.ops.folio_cpu.sample_rows(x, torch.tensor([r]), torch.tensor([t]), torch.tensor([k]),
                                               torch.tensor([p]), torch.tensor([m]),
                                               torch.tensor([u], dtype=torch.float64))
    assert int(one(0)) == 7  # the first NaN, as argmax_rows (the engine's NaN check sees it)
    assert int(one(0, k=3, p=0.5)) == 7
    assert int(one(1)) == 0 and int(one(1, k=5, p=0.3)) == 0  # nothing to draw from: 0
    assert int(one(2, t=1e-30)) == int(x[2].argmax())  # a tiny temperature is the argmax
    assert int(one(2, k=1, u=0.99)) == int(x[2].argmax()) == int(one(2, p=1e-6, u=0.99))
    for bad in (dict(r=3), dict(r=-1), dict(r=2, t=0.0), dict(r=2, t=float("inf")), dict(r=2, t=-1.0),
                dict(r=2, u=1.0), dict(r=2, u=-0.5), dict(r=2, u=float("nan")), dict(r=2, p=0.0),
                dict(r=2, p=1.5), dict(r=2, p=float("nan")), dict(r=2, m=-0.1), dict(r=2, m=2.0),
                dict(r=2, m=float("nan"))):
        with pytest.raises(RuntimeError, match="sample_rows"):
            one(**bad)
    with pytest.raises(RuntimeError, match="sample_rows"):  # vectors of different lengths
        torch.ops.folio_cpu.sample_rows(x, torch.tensor([0, 1]), torch.tensor([1.0]), torch.tensor([0, 0]),
                                        torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]),
                                        torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert draw_rows(x.half(), [2], [1.0], [0], [1.0], [0.0], [0.5]) is None  # float16: the torch path
