"""Small fused ops for the CPU forward (cpu_ops.cpp, built into the attention's library by
cpu_attention.py), each falling back to the reference's torch chain (reference.py), which is
also its oracle in the tests. backend.py gives them to the model with the C++ attention.

`argmax_rows` is exact for every float32 or bfloat16 input (torch.argmax's first maximum, its
NaN rule), so greedy sampling uses it at every dtype, on bfloat16 logits without a float copy.
`rope_write_kv` is bit-identical to the torch chain it replaces. The others (`rms_norm`,
`add_rms_norm`, `silu_mul`) keep transformers' roundings but sum a row's squares in another
order and take exp from another library: float32 results differ from torch's in the last bit
now and then, as the C++ attention's do (its sums run in another order than torch's SDPA);
the greedy tokens stay HF's (tests/engine/test_parity_hf.py, whose references have no step
with a top-2 margin under 1e-5). float32 used the torch chains until 2026-12-05: at a
512-token prefill of the tiny Llama they took ~10 ms of ~150 (mul, silu, add, cat, pow,
index_copy), against vLLM's ~4 ms of compiled kernels.
"""

from __future__ import annotations

import torch

from folio.kernels import cpu_attention, reference
from folio.kernels.errors import KernelInputError


def available() -> bool:
    """The library is built and loaded (a CPU with a C++ compiler)."""
    return cpu_attention.load() is None  # once built, a lock and a dict lookup


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D tensor, the same indices."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.numel()
            and available()):
        return torch.ops.folio_cpu.argmax_rows(x if x.stride(1) == 1 else x.contiguous())
    return x.argmax(dim=-1)


def can_sample(x: torch.Tensor) -> bool:
    """sample_rows takes `x` (else the caller's torch path)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.numel() > 0
            and x.stride(1) == 1 and available())


def sample_rows(x: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """One token per row of x[rows] drawn from softmax(x / temps) with top_k, top_p and min_p,
    at the uniforms `u` (float64, [0, 1)) by the inverse CDF, as sampler._draw(sampler._filter(...))
    draws; None where the library cannot (can_sample)."""
    return torch.ops.folio_cpu.sample_rows(x, rows, temps, top_k, top_p, min_p, u) if can_sample(x) else None


def _fused(*ts: torch.Tensor) -> bool:
    return (ts[0].dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == ts[0].dtype and t.device.type == "cpu" for t in ts) and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and x.stride(1) == 1 and _fused(x, weight):
        out = torch.empty_like(x)
        torch.ops.folio_cpu.rms_norm(x, weight, eps, out)
        return out
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + r, rms_norm(h + r)), the sum written into h."""
    if h.dim() == 2 and h.shape == r.shape and h.stride(1) == 1 and r.stride(1) == 1 and _fused(h, r, weight):
        out = torch.empty_like(h)
        torch.ops.folio_cpu.add_rms_norm(h, r, weight, eps, out)
        return h, out
    return reference.add_rms_norm(h, r, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0 and _fused(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        torch.ops.folio_cpu.silu_mul(gate_up, out)
        return out
    return reference.silu_mul(gate_up)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """q rotated [T, heads, D], with k rotated and v written to their cache slots (bit-identical
    to the model's torch chain, RotaryEmbedding.rotate + write_kv) where the rotation spans the
    whole head dim (cos: [T, 1, D]). None where it does not apply: the caller runs the chain."""
    T, D = qkv.shape[0], k_cache.shape[-1] if k_cache.dim() == 4 else 0
    if not (qkv.dim() == 2 and qkv.stride(1) == 1 and cos.dim() == 3 and cos.shape[-1] == D
            and _fused(qkv, cos, sin, k_cache, v_cache) and k_cache.stride(2) == D and k_cache.stride(3) == 1
            and v_cache.stride() == k_cache.stride()):
        return None
    q = qkv.new_empty(T, num_heads, D)
    try:
        torch.ops.folio_cpu.rope_write_kv(qkv, cos[:, 0], sin[:, 0], num_heads, num_kv_heads, k_cache, v_cache,
                                          slot_mapping.to(torch.long), q)
    except RuntimeError as e:  # its checks (a slot past the cache): write_kv's class of error
        raise KernelInputError(str(e).split("\n")[0]) from None
    return q
