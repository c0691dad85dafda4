"""The model's linear layers: Folio's float32 panels (the CPU default on AVX-512) and the
oneDNN path against F.linear and float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kernels.linear import Linear, linear_backend, panels_available

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    ref = F.linear(x, w, b)
    lin = Linear(w, b, "onednn")
    assert lin.weight is None, "the oneDNN path must not keep a second copy of the weight"
    out = lin(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Linear(w, b, "torch")(x), ref, rtol=0, atol=0)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bf16 instructions")
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_onednn_bf16_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 40, generator=g).bfloat16()
    out = Linear(w, b, "onednn")(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b))  # bf16's own tolerance
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-1)


def test_non_contiguous_input():
    w = torch.randn(32, 16)
    x = torch.randn(5, 48)[:, 8:24]  # a column slice: rows not adjacent
    assert not x.is_contiguous()
    torch.testing.assert_close(Linear(w, None, "onednn")(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


needs_panels = pytest.mark.skipif(not panels_available(), reason="no AVX-512 or no C++ compiler here")


def _within_float32_sum_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """out is x @ w.T + b up to float32's error of a K-term sum (each partial sum rounded
    once, |error| <= K * eps * sum |x_k w_k|, plus the bias's rounding), against float64."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    bound = (x.shape[1] + 2) * 2.0 ** -24 * (F.linear(x.double().abs(), w.double().abs())
                                            + (0 if b is None else b.double().abs()))
    assert out.dtype == torch.float32 and out.shape == ref.shape
    excess = (out.double() - ref).abs() - bound
    if excess.numel():
        assert excess.max().item() <= 0, f"past the bound by {excess.max().item():.3g}"


@needs_panels
@settings(max_examples=120, deadline=None, derandomize=True)
@given(rows=st.integers(0, 300), out_features=st.integers(1, 200), in_features=st.integers(1, 160),
       bias=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_panels_match_float64(rows, out_features, in_features, bias, threads, seed):
    """Every row count (the 8-row blocks and their tails, the 128-row blocks), every output
    width (the 48-column panels and a last one cut short), odd and even K (the k pairs and
    the one left), one thread or two (each prefetching the next panel of its range)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g) * 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lin = Linear(w, b, "panels")
        out = lin(x)
    finally:
        torch.set_num_threads(before)
    assert lin.weight is None, "the panels path must not keep a second copy of the weight"
    _within_float32_sum_error(out, x, w, b)


@needs_panels
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_panels_at_a_models_shapes(rows):
    """SmolLM2-135M's gate-up and down shapes at decode and prefill sizes: many panels a
    thread, several row blocks, K past the L1 cache."""
    g = torch.Generator().manual_seed(rows)
    for n, k in ((3072, 576), (576, 1536)):
        w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(rows, k, generator=g)
        _within_float32_sum_error(Linear(w, None, "panels")(x), x, w, None)


@needs_panels
def test_panels_take_a_non_contiguous_input_and_refuse_bad_ones():
    w, b = torch.randn(50, 16), torch.randn(50)
    lin = Linear(w, b, "panels")
    x = torch.randn(5, 48)[:, 8:24]
    assert not x.is_contiguous()
    _within_float32_sum_error(lin(x), x, w, b)
    with pytest.raises(RuntimeError, match="float32"):
        lin(x.bfloat16())
    with pytest.raises(RuntimeError, match=r"\[rows, 16\]"):
        lin(torch.randn(3, 17))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.folio_cpu.pack_linear_weight(w.double())
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.folio_cpu.linear_panels(x, lin._panels, 50, torch.randn(49))
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.folio_cpu.linear_panels(x, lin._panels, 200, None)


@needs_panels
@settings(max_examples=6, deadline=None, derandomize=True)
@given(rows=st.integers(513, 700), out_features=st.integers(500, 1400), in_features=st.integers(300, 700),
       seed=st.integers(0, 2 ** 16))
def test_panels_in_chunks_match_float64(rows, out_features, in_features, seed):
    """Past 512 rows the float32 panels go in chunks of 1 MiB a thread (~9 panels of 48 columns at
    K = 576) with every row passing over each chunk, 8 at a time: widths of one to three chunks
    a thread, row counts that end inside an 8-row block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    _within_float32_sum_error(Linear(w, b, "panels")(x), x, w, b)


def _within_bf16_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """out is x @ w.T + b in float32 sums rounded once to bf16: half a bf16 step of the result
    plus float32's error of a K-term sum, against float64."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    bound = 2.0 ** -8 * ref.abs() + (x.shape[1] + 2) * 2.0 ** -23 * (
        F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs()))
    excess = (out.double() - ref).abs() - bound
    if excess.numel():
        assert excess.max().item() <= 0, f"past the bound by {excess.max().item():.3g}"


needs_tiles = pytest.mark.skipif(not panels_available(torch.bfloat16), reason="no AMX here")


@needs_tiles
@settings(max_examples=80, deadline=None, derandomize=True)
@given(rows=st.integers(0, 100), out_features=st.integers(1, 100), in_features=st.integers(1, 100),
       bias=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_amx_tiles_match_float64(rows, out_features, in_features, bias, threads, seed):
    """The bfloat16 tiles: every row count (32-row blocks read in place, the rest from
    a padded copy), widths past and short of a pair of 16-column panels, K short of a 32-step;
    float32 sums rounded once to bf16 (half a bf16 step of the result, plus float32's sum error)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = Linear(w, b, "panels")(x)
    finally:
        torch.set_num_threads(before)
    _within_bf16_rounding(out, x, w, b)


@needs_tiles
@settings(max_examples=8, deadline=None, derandomize=True)
@given(rows=st.integers(65, 300), out_features=st.integers(900, 2300), in_features=st.integers(300, 700),
       seed=st.integers(0, 2 ** 16))
def test_amx_tiles_in_chunks_match_float64(rows, out_features, in_features, seed):
    """Past 64 rows the tiles walk a thread's panels in chunks that stay in L2 (1 MiB: ~29 pairs
    of panels at K = 576) while 64 rows at a time pass over them: widths of one to three chunks a
    thread, row counts that end inside a 64-row block and inside a 32-row one."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    _within_bf16_rounding(Linear(w, b, "panels")(x), x, w, b)


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("FOLIO_LINEAR_BACKEND", raising=False)
    assert linear_backend(cpu, torch.float32) == ("panels" if panels_available() else "onednn")
    assert linear_backend(cpu, torch.bfloat16) == ("panels" if panels_available(torch.bfloat16) else "onednn"
                                                   if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch")
    assert linear_backend(cpu, torch.float16) == "torch"
    assert linear_backend(torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "torch")
    assert linear_backend(cpu, torch.float32) == "torch"
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "onednn")
    assert linear_backend(cpu, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="float32"):
        linear_backend(cpu, torch.float16)
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "panels")
    with pytest.raises(ValueError, match="float32"):
        linear_backend(cpu, torch.float16)
    if panels_available(torch.bfloat16):  # the tiles
        assert linear_backend(cpu, torch.bfloat16) == "panels"
    else:
        with pytest.raises(ValueError, match="AMX"):
            linear_backend(cpu, torch.bfloat16)
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "mkl")
    with pytest.raises(ValueError, match="FOLIO_LINEAR_BACKEND"):
        linear_backend(cpu, torch.float32)


def test_engine_uses_the_default_backend_on_cpu(model_dirs, monkeypatch):
    from folio.worker import LLM
    monkeypatch.delenv("FOLIO_LINEAR_BACKEND", raising=False)
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=64)
    want = "panels" if panels_available() else "onednn"
    assert {layer.qkv.backend for layer in llm.engine.runner.model.layers} == {want}
    assert llm.engine.runner.model.lm_head.backend == want
