"""The C++ CPU attention (kernels/cpu_attention.py) against float64 dense attention and the torch
reference, on generated paged layouts: decode rows and prefill rows in place (whole prompts,
chunks after a cached context, prompts over many tiles of keys), block-major strided caches,
GQA, head dims that are no multiple of 16, bf16; bad tables refused with a clear error (never a
read out of bounds); and the fallback to the reference when no compiler can build it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kernels import backend, cpu_attention, reference
from folio.kernels.errors import KernelInputError
from tests.engine.test_kernels_reference import block_major, dense_reference, make_case

pytestmark = pytest.mark.skipif(cpu_attention.load() is not None, reason="no C++ compiler here")


PREFILL_BY_SDPA = cpu_attention.prefill_by_sdpa  # the rule itself (the fixture below replaces it)


@pytest.fixture(autouse=True, scope="module")
def _the_prefill_kernel_for_every_dtype():
    """These tests are the kernels': on a CPU with AMX, bf16 prefills would go to SDPA
    (prefill_by_sdpa), and the kernel's bf16 prefill would go untested there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_attention, "prefill_by_sdpa", lambda dtype: False)
        yield


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 8, 16, 32]))
    num_kv_heads = draw(st.integers(1, 4))
    gqa = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([8, 16, 64, 80, 128]))
    n = draw(st.integers(1, 6))
    ctx = draw(st.lists(st.integers(1, 3 * block_size + 40), min_size=n, max_size=n))
    # most rows decode; some prefill (whole, or a chunk after a cached context)
    q_lens = [1 if draw(st.booleans()) or c == 1 else draw(st.integers(1, c)) for c in ctx]
    return block_size, num_kv_heads * gqa, num_kv_heads, head_dim, q_lens, ctx, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(batches(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_matches_dense_attention_and_the_reference(case, dtype, strided):
    block_size, heads, kv_heads, head_dim, q_lens, ctx, seed = case
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx, heads, kv_heads, head_dim, block_size, dtype)
    if strided:  # the engine's layout: other layers' blocks in between hold NaN
        kc, vc, _ = block_major(kc, vc)
    scale = head_dim ** -0.5
    plan = cpu_attention.plan(tables, lens, qsl, block_size, 0)
    assert plan.decode == [] and plan.decode_rows.rows.numel() == sum(1 for x in q_lens if x == 1)
    assert plan.prefill == [] and plan.prefill_batches == []
    assert plan.prefill_rows.q_lens.tolist() == [x for x in q_lens if x > 1]
    out = cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, scale, plan=plan)
    ref = reference.paged_attention(q, kc, vc, tables, lens, qsl, scale)
    dense = dense_reference(q, ks, vs, q_lens, ctx, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out.double(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


@st.composite
def long_prefills(draw):
    """Prompts over several 64-key tiles and 32-position tasks: whole, or a chunk after a cached
    part that ends anywhere in a tile."""
    block_size = draw(st.sampled_from([1, 16, 32]))
    kv_heads = draw(st.integers(1, 3))
    gqa = draw(st.sampled_from([1, 2, 3, 5]))
    head_dim = draw(st.sampled_from([16, 48, 64, 72, 128]))
    n = draw(st.integers(1, 3))
    ctx = draw(st.lists(st.integers(2, 300), min_size=n, max_size=n))
    q_lens = [c if draw(st.booleans()) else draw(st.integers(2, c)) for c in ctx]
    return block_size, kv_heads * gqa, kv_heads, head_dim, q_lens, ctx, draw(st.integers(0, 2**31))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(long_prefills(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_long_prefills_match_dense_attention(case, dtype):
    block_size, heads, kv_heads, head_dim, q_lens, ctx, seed = case
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, q_lens, ctx, heads, kv_heads, head_dim, block_size, dtype)
    kc, vc, _ = block_major(kc, vc)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))  # every row must be written
    cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, scale, out=out)
    dense = dense_reference(q, ks, vs, q_lens, ctx, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), dense, atol=tol, rtol=tol)


def test_prefills_past_the_kernels_head_dim_go_to_the_reference():
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, [1, 6, 9], [12, 6, 20], 2, 1, 272, 8, torch.float32)
    got = cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, 0.06)
    torch.testing.assert_close(got.double(), dense_reference(q, ks, vs, [1, 6, 9], [12, 6, 20], 0.06),
                               atol=2e-5, rtol=2e-5)


def test_the_reference_replans_a_plan_made_for_the_kernel():
    gen = torch.Generator().manual_seed(1)
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, [1, 4, 1], [20, 9, 3], 4, 2, 16, 8, torch.float32)
    plan = cpu_attention.plan(tables, lens, qsl, 8, 0)  # no decode chunks: the reference must not skip rows
    got = reference.paged_attention(q, kc, vc, tables, lens, qsl, 0.25, plan=plan)
    torch.testing.assert_close(got.double(), dense_reference(q, ks, vs, [1, 4, 1], [20, 9, 3], 0.25),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", ["block_out_of_range", "negative_block", "context_past_table", "rows_past_q",
                                 "more_new_tokens_than_context", "no_new_token"])
def test_bad_prefill_tables_are_refused_before_anything_is_read(bad):
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, tables, lens, qsl, _, _ = make_case(gen, [5, 9], [20, 9], 4, 2, 16, 8, torch.float32)
    plan = cpu_attention.plan(tables, lens, qsl, 8, 0)
    p = plan.prefill_rows
    if bad == "block_out_of_range":
        p.block_tables[0, 2] = kc.shape[0] + 10**6
    elif bad == "negative_block":
        p.block_tables[1, 1] = -7
    elif bad == "context_past_table":
        p.seq_lens[0] = p.block_tables.shape[1] * 8 + 1
    elif bad == "rows_past_q":
        p.q_starts[1] = q.shape[0] - 3
    elif bad == "more_new_tokens_than_context":
        p.q_lens[1] = 10
    else:
        p.q_lens[0] = 0
    with pytest.raises(KernelInputError, match="sequence [01]"):
        cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, 0.25, plan=plan)


@pytest.mark.parametrize("bad", ["block_out_of_range", "negative_block", "context_past_table", "row_past_q"])
def test_bad_tables_are_refused_before_anything_is_read(bad):
    gen = torch.Generator().manual_seed(2)
    q, kc, vc, tables, lens, qsl, _, _ = make_case(gen, [1, 1], [20, 5], 4, 2, 16, 8, torch.float32)
    plan = cpu_attention.plan(tables, lens, qsl, 8, 0)
    d = plan.decode_rows
    if bad == "block_out_of_range":
        d.block_tables[0, 1] = kc.shape[0] + 10**6
    elif bad == "negative_block":
        d.block_tables[1, 0] = -1
    elif bad == "context_past_table":
        d.seq_lens[0] = d.block_tables.shape[1] * 8 + 1
    else:
        d.rows[1] = q.shape[0]
    with pytest.raises(KernelInputError, match="sequence [01]"):
        cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, 0.25, plan=plan)


def test_other_dtypes_go_to_the_reference():
    gen = torch.Generator().manual_seed(4)
    q, kc, vc, tables, lens, qsl, ks, vs = make_case(gen, [1, 3], [11, 3], 4, 2, 16, 4, torch.float16)
    got = cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, 0.25)
    assert torch.equal(got, reference.paged_attention(q, kc, vc, tables, lens, qsl, 0.25))


def test_the_default_cpu_backend_is_the_kernel(monkeypatch):
    monkeypatch.delenv("FOLIO_ATTENTION_BACKEND", raising=False)
    assert backend.get_ops("cpu").name == "cpp"
    monkeypatch.setenv("FOLIO_ATTENTION_BACKEND", "torch")
    assert backend.get_ops("cpu").name == "torch"


def test_without_a_compiler_the_cpu_path_is_the_reference(tmp_path):
    """A fresh process with an empty kernel cache and a compiler that fails: the default falls
    back to the reference with one warning; asking for cpp by name is a clear error."""
    code = ("import logging, os; logging.basicConfig();"
            "from folio.kernels import backend;"
            "print(backend.get_ops('cpu').name);"
            "os.environ['FOLIO_ATTENTION_BACKEND'] = 'cpp';\n"
            "try: backend.get_ops('cpu')\n"
            "except ValueError as e: print('refused:', e)")
    env = dict(os.environ, CXX="false", FOLIO_KERNEL_CACHE=str(tmp_path))
    env.pop("FOLIO_ATTENTION_BACKEND", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "torch"
    assert lines[1].startswith("refused: FOLIO_ATTENTION_BACKEND=cpp: the CPU attention kernel could not be built")
    assert done.stderr.count("attention runs on the torch reference") == 1
    assert os.listdir(tmp_path) == []  # the failed build left no file behind


def test_loading_the_kernel_keeps_subnormal_floats():
    """Built with -ffast-math and linked with it, the library would set flush-to-zero for the
    whole process at load (gcc's crtfastmath.o): every torch op would then lose subnormals."""
    code = ("import torch; from folio.kernels import cpu_attention; assert cpu_attention.load() is None;"
            "x = torch.tensor([1e-39, 1e-42]); print(bool((x * 1.0 != 0).all()), bool((x / 2 != 0).all()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 levels")
def test_the_library_compiles_for_a_cpu_without_avx512():
    """The build is -march=native, so this CPU's instructions never show what an AVX2-only one
    (x86-64-v3: many AMD and older Intel hosts) would make of the sources; there the library
    once failed to build at all (an inline-asm register hint sized for AVX-512), and every op
    silently fell back to torch. Each source, compiled as the build does (-O3: the hint failed
    only when optimizing) for x86-64-v3, to assembly and no further."""
    import concurrent.futures

    from torch.utils.cpp_extension import include_paths

    flags = [f for f in cpu_attention.COMPILE if f not in ("-march=native", "-c")] + ["-march=x86-64-v3", "-S"]

    def compile_(source: str) -> subprocess.CompletedProcess:
        extra = cpu_attention.PER_SOURCE.get(os.path.basename(source), [])
        return subprocess.run([os.environ.get("CXX", "c++"), *flags, *extra, *[f"-I{p}" for p in include_paths()],
                               source, "-o", os.devnull], capture_output=True, text=True, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for source, done in zip(cpu_attention.SOURCES, pool.map(compile_, cpu_attention.SOURCES)):
            assert done.returncode == 0, f"{os.path.basename(source)}: {done.stderr[-1500:]}"


def test_bf16_prefills_take_sdpa_on_a_cpu_with_amx(monkeypatch):
    """Where prefill_by_sdpa says so (bf16 on AMX), a mixed batch's prefills are the torch path's
    to the bit, planned once for every layer, while its decode rows stay the kernel's; float32
    and CPUs without AMX keep the kernel."""
    gen = torch.Generator().manual_seed(3)
    q_lens, ctx = [1, 37, 1, 64, 64], [50, 37, 9, 64, 64]  # decode rows, a prompt, two of one length
    q, kc, vc, tables, lens, qsl, _, _ = make_case(gen, q_lens, ctx, 6, 2, 64, 16, torch.bfloat16)
    kc, vc, _ = block_major(kc, vc)
    kernel = cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, 0.125)  # the fixture: the kernel
    monkeypatch.setattr(cpu_attention, "prefill_by_sdpa", lambda dtype: dtype == torch.bfloat16)
    plan = cpu_attention.plan(tables, lens, qsl, 16, 0)
    outs = [cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, 0.125, plan=plan) for _ in range(2)]
    torch_prefills = plan.torch_prefills
    assert torch_prefills is not None and len(torch_prefills.prefill_batches) == 1 and len(torch_prefills.prefill) == 1
    ref = reference.paged_attention(q, kc, vc, tables, lens, qsl, 0.125)
    prefill_rows = [r for s, n in enumerate(q_lens) if n > 1 for r in range(int(qsl[s]), int(qsl[s + 1]))]
    decode_rows = [int(qsl[s]) for s, n in enumerate(q_lens) if n == 1]
    for out in outs:
        assert torch.equal(out[prefill_rows], ref[prefill_rows])
        assert torch.equal(out[decode_rows], kernel[decode_rows])
    assert plan.torch_prefills is torch_prefills  # the second call read the first one's plan
    assert not torch.equal(kernel[prefill_rows], ref[prefill_rows])  # (the two paths differ: the test can tell)
    monkeypatch.undo()
    for flags, dtype, want in (("fpu avx512f amx_tile amx_bf16", torch.bfloat16, True),
                               ("fpu avx512f amx_tile amx_bf16", torch.float32, False),
                               ("fpu avx512f avx512_bf16", torch.bfloat16, False)):
        monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda flags=flags: "flags\t: " + flags)
        monkeypatch.delitem(cpu_attention._state, "amx", raising=False)
        assert PREFILL_BY_SDPA(dtype) is want, (flags, dtype)
    monkeypatch.delitem(cpu_attention._state, "amx", raising=False)
