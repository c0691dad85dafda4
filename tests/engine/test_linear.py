"""The model's linear layers: the oneDNN path (CPU default) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio.kernels.linear import Linear, linear_backend

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


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("FOLIO_LINEAR_BACKEND", raising=False)
    assert linear_backend(cpu, torch.float32) == "onednn"
    assert linear_backend(cpu, torch.bfloat16) == ("onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch")
    assert linear_backend(cpu, torch.float16) == "torch"
    assert linear_backend(torch.device("cuda"), torch.float32) == "torch"
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "torch")
    assert linear_backend(cpu, torch.float32) == "torch"
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "onednn")
    with pytest.raises(ValueError, match="float32"):
        linear_backend(cpu, torch.float16)
    monkeypatch.setenv("FOLIO_LINEAR_BACKEND", "mkl")
    with pytest.raises(ValueError, match="FOLIO_LINEAR_BACKEND"):
        linear_backend(cpu, torch.float32)


def test_engine_uses_onednn_on_cpu(model_dirs, monkeypatch):
    from folio.worker import LLM
    monkeypatch.delenv("FOLIO_LINEAR_BACKEND", raising=False)
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=64)
    assert {layer.qkv.backend for layer in llm.engine.runner.model.layers} == {"onednn"}
    assert llm.engine.runner.model.lm_head.backend == "onednn"
