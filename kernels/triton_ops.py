"""The forward's small ops as Triton kernels, one launch each, for 16-bit models on the GPU.

On CUDA a SmolLM2 decode step was launch-bound (benchmarks/gpu_check.py on an H200,
2026-12-04): 824-946 kernel launches and ~2 ms of device time in a 9-14 ms step. torch's
reference chains (reference.py) are most of those launches: RMSNorm is 6-8 kernels (casts,
pow, mean, add, rsqrt, two products), the residual add one more, SiLU*up two. Here each is one:

    rms_norm        y = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
    add_rms_norm    h += r (rounded to the dtype, into h), then rms_norm(h)
    silu_mul        silu(gate).to(dtype) * up, gate_up = [gate | up]
    rope_write_kv   q and k rotated (rotate-half), k and v written to their cache slots, q
                    returned: rope.py's chain (neg, cat, two products, a sum) + write_kv

with transformers' roundings (statistics in float32, each product of two 16-bit values rounded
once), so they differ from the chains only in the order a row's squares are summed; the rotary
op not at all (each 16-bit product is exact in float32, then rounded as torch rounds it). That is
why float32 keeps torch's chains, token-identical to HF, as on the CPU (cpu_ops.py): the
fused ops serve bfloat16 and float16 only. Tested under TRITON_INTERPRET in float16 (the
interpreter mishandles bfloat16 loads); bfloat16 and the speed need a GPU (gpu_check.py runs
gpu_engine_speed.fused_ops_ab).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from folio.kernels import reference

FUSED_DTYPES = (torch.bfloat16, torch.float16)
log = logging.getLogger("folio.kernels")
_broken: list[str] = []  # set when a launch failed (a compiler that rejects a kernel): chains from then on


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:  # the residual add, rounded to the dtype as torch's add is, stored back into x
        r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=m)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n
    y = (h * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # F.silu: float32 inside, rounded
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_qkv, stride_cs, stride_qt, stride_qh,
                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          NH: tl.constexpr, NKV: tl.constexpr, HEADS_P: tl.constexpr, KV_P: tl.constexpr,
                          HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Token t: its NH + NKV q/k heads rotated (q to q_ptr, k to the cache), its NKV v heads copied."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HALF_P)[None, :]
    ok = (h < NH + NKV) & (d < HALF)
    row = qkv_ptr + t * stride_qkv + h * (2 * HALF)
    x1 = tl.load(row + d, mask=ok, other=0.0)
    x2 = tl.load(row + HALF + d, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype, as torch's ops are
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    is_q = h < NH
    tl.store(q_ptr + t * stride_qt + h * stride_qh + d, o1, mask=ok & is_q)
    tl.store(q_ptr + t * stride_qt + h * stride_qh + HALF + d, o2, mask=ok & is_q)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        kh = tl.where(is_q, 0, h - NH)
        kdst = k_cache_ptr + blk * stride_kb + off * stride_ks + kh * stride_kh
        tl.store(kdst + d, o1, mask=ok & ~is_q)
        tl.store(kdst + HALF + d, o2, mask=ok & ~is_q)
        v = tl.arange(0, KV_P)[:, None]
        e = tl.arange(0, 2 * HALF_P)[None, :]
        vok = (v < NKV) & (e < 2 * HALF)
        vals = tl.load(qkv_ptr + t * stride_qkv + (NH + NKV + v) * (2 * HALF) + e, mask=vok, other=0.0)
        tl.store(v_cache_ptr + blk * stride_vb + off * stride_vs + v * stride_vh + e, vals, mask=vok)


def _fused(*ts: torch.Tensor) -> bool:
    t0 = ts[0]
    return (not _broken and t0.dtype in FUSED_DTYPES and all(t.dtype == t0.dtype and t.device == t0.device for t in ts)
            and t0.dim() == 2 and t0.stride(1) == 1 and t0.shape[0] > 0)


def _norm(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](x, r if r is not None else x, weight, out, x.stride(0),
                                    r.stride(0) if r is not None else 0, out.stride(0), n, eps,
                                    HAS_RES=r is not None, BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return out


def _give_up(e: Exception) -> None:
    """These kernels have not yet met every compiler and GPU: one that fails to build or launch
    sends every later call to torch's chains, said once in the log, rather than failing steps."""
    if not _broken:
        log.warning("the fused Triton small ops failed (%s: %s); torch's chains from now on", type(e).__name__, e)
    _broken.append(type(e).__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fused(x) and weight.dtype == x.dtype and weight.is_contiguous() and weight.shape == x.shape[1:]:
        try:
            return _norm(x, None, weight, eps)
        except Exception as e:  # noqa: BLE001 - see _give_up (nothing was written: the output is new)
            _give_up(e)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + r, rms_norm(h + r)), the sum written into h."""
    if (_fused(h, r) and r.shape == h.shape and r.stride(1) == 1 and weight.dtype == h.dtype
            and weight.is_contiguous() and weight.shape == h.shape[1:]):
        try:
            return h, _norm(h, r, weight, eps)
        except Exception as e:  # noqa: BLE001 - a launch that failed ran nothing: h is unchanged
            _give_up(e)
    return reference.add_rms_norm(h, r, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _fused(gate_up) and gate_up.shape[1] % 2 == 0:
        n = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], n)
        block = min(1024, triton.next_power_of_2(n))
        try:
            _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                                        out.stride(0), n, BLOCK=block)
            return out
        except Exception as e:  # noqa: BLE001 - see _give_up
            _give_up(e)
    return reference.silu_mul(gate_up)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """cpu_ops.rope_write_kv's contract: q rotated [T, heads, D], with k rotated and v written to
    their cache slots (a negative slot skipped), bit-identical to RotaryEmbedding.rotate +
    write_kv; None where it does not apply (float32, a partial rotation, other layouts): the
    caller runs the chain."""
    T, D = qkv.shape[0], k_cache.shape[-1] if k_cache.dim() == 4 else 0
    if not (_fused(qkv) and D % 2 == 0 and k_cache.device == v_cache.device == qkv.device
            and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * D and cos.dim() == 3 and cos.shape[-1] == D
            and cos.dtype == sin.dtype == qkv.dtype and cos.stride(-1) == 1 and sin.stride() == cos.stride()
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and v_cache.dtype == k_cache.dtype == qkv.dtype):
        return None
    q = qkv.new_empty(T, num_heads, D)
    try:
        _rope_write_kv_kernel[(T,)](
            qkv, cos, sin, q, k_cache, v_cache, slot_mapping.to(torch.long), qkv.stride(0), cos.stride(0),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NH=num_heads, NKV=num_kv_heads, HEADS_P=triton.next_power_of_2(num_heads + num_kv_heads),
            KV_P=triton.next_power_of_2(num_kv_heads), HALF=D // 2, HALF_P=triton.next_power_of_2(D // 2),
            BLOCK_SIZE=k_cache.shape[1])
    except Exception as e:  # noqa: BLE001 - see _give_up; the caller runs the chain, which rewrites all
        _give_up(e)
        return None
    return q
