"""Which implementation of the kernel ops runs — decided here and nowhere else.

    FOLIO_ATTENTION_BACKEND=torch|cpp|triton   overrides the choice
    default                                     triton on CUDA (for 16-bit models with the fused
                                                norms, SiLU and rotary + KV write of triton_ops.py);
                                                on CPU cpp (decode attention in
                                                C++, cpu_attention.py, and for bfloat16 the fused
                                                norms, SiLU and rotary + KV write of cpu_ops.py)
                                                when it builds, else torch

Tests run the Triton kernels on CPU with TRITON_INTERPRET=1 (set before triton is
imported) and FOLIO_ATTENTION_BACKEND=triton.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from folio.kernels import attention_plan, reference

BACKENDS = ("torch", "cpp", "triton")
log = logging.getLogger("folio.kernels")


@dataclass(frozen=True)
class KernelOps:
    name: str
    write_kv: Callable
    paged_attention: Callable
    copy_blocks: Callable
    swap_blocks: Callable
    plan_attention: Callable  # (block_tables, seq_lens, query_start_loc, block_size, kv_bytes) -> plan
    # the forward's small ops (reference.py's contracts); fused in C++ for bfloat16 on CPU
    rms_norm: Callable = reference.rms_norm
    add_rms_norm: Callable = reference.add_rms_norm
    silu_mul: Callable = reference.silu_mul
    # q rotated with k and v written to the cache in one op, or None where it does not apply
    # (the model then rotates and calls write_kv): cpu_ops.rope_write_kv on the C++ backend
    rope_write_kv: Callable | None = None


TORCH_OPS = KernelOps("torch", reference.write_kv, reference.paged_attention, reference.copy_blocks,
                      reference.swap_blocks, attention_plan.plan_attention)


def _plan_for_triton(block_tables, seq_lens, query_start_loc, block_size, kv_bytes_per_token):
    """The Triton kernel needs only its grid: the longest query and the longest context of the
    batch (one read from the device for both)."""
    if not seq_lens.numel():
        return attention_plan.AttentionPlan(decode=[], prefill=[], max_query_len=0, max_seq_len=0)
    max_q, max_len = torch.stack([(query_start_loc[1:] - query_start_loc[:-1]).max(),
                                  seq_lens.max().to(query_start_loc.dtype)]).tolist()
    return attention_plan.AttentionPlan(decode=[], prefill=[], max_query_len=max_q, max_seq_len=max_len)


def _triton_ops() -> KernelOps:
    from folio.kernels import triton_ops
    from folio.kernels.copy_blocks import copy_blocks
    from folio.kernels.paged_attention import paged_attention
    from folio.kernels.write_kv import write_kv

    # swap_blocks stays a batched torch copy (device <-> pinned host): no kernel beats the copy engine;
    # the small ops one launch each for 16-bit models (float32 keeps torch's, HF-identical)
    return KernelOps("triton", write_kv, paged_attention, copy_blocks, reference.swap_blocks, _plan_for_triton,
                     triton_ops.rms_norm, triton_ops.add_rms_norm, triton_ops.silu_mul, triton_ops.rope_write_kv)


def _cpp_ops() -> KernelOps:
    from folio.kernels import cpu_attention, cpu_ops

    return KernelOps("cpp", reference.write_kv, cpu_attention.paged_attention, reference.copy_blocks,
                     reference.swap_blocks, cpu_attention.plan, cpu_ops.rms_norm, cpu_ops.add_rms_norm,
                     cpu_ops.silu_mul, cpu_ops.rope_write_kv)


_warned: set[str] = set()


def attention_backend(device: torch.device) -> str:
    name = os.environ.get("FOLIO_ATTENTION_BACKEND", "").strip().lower()
    if name and name not in BACKENDS:
        raise ValueError(f"FOLIO_ATTENTION_BACKEND must be one of {BACKENDS}, got {name!r}")
    if name == "cpp" and device.type != "cpu":
        raise ValueError("FOLIO_ATTENTION_BACKEND=cpp runs on CPU only")
    if name == "cpp" or (not name and device.type == "cpu"):
        from folio.kernels import cpu_attention

        why = cpu_attention.load()
        if why is not None:
            if name == "cpp":
                raise ValueError(f"FOLIO_ATTENTION_BACKEND=cpp: {why}")
            if why not in _warned:
                _warned.add(why)
                log.warning("%s; attention runs on the torch reference", why)
            return "torch"
        return "cpp"
    return name or ("triton" if device.type == "cuda" else "torch")


def get_ops(device: torch.device | str) -> KernelOps:
    name = attention_backend(torch.device(device))
    return _triton_ops() if name == "triton" else _cpp_ops() if name == "cpp" else TORCH_OPS
