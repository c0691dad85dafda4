"""The model's matrix products, y = x @ w.T + b, with the weight prepared once at load.

    FOLIO_LINEAR_BACKEND=torch|onednn|panels   overrides the choice
    default   panels (Folio's own kernels): cpu_linear.cpp for float32 on a CPU with AVX-512,
              cpu_linear_amx.cpp's tiles for bfloat16 on a CPU with AMX; onednn elsewhere for
              float32, and for bfloat16 on a CPU with bf16 instructions, where torch has
              oneDNN; torch (F.linear) everywhere else

Why oneDNN on CPU: torch's F.linear goes to MKL's sgemm, which repacks the weight
on every call; at decode batch sizes (a few to a few hundred rows) that repacking
is most of the work. oneDNN with the weight reordered once into its blocked
layout ran the tiny Llama's decode matmuls 1.6x faster and its lm_head 2.4x
faster on the 2-core EPYC here (benchmarks/vs_peers_offline.py records the
effect); vLLM's CPU backend does the same. Both are float32 with float32
accumulation; they differ only in summation order (max |error| vs. float64 of
the same order, ~1e-4 at |y| ~ 20), so greedy outputs stay those of transformers
(tests/engine/test_parity_hf.py runs on this path; tests/engine/test_linear.py checks the
backends against each other).

float32 on AVX-512 (2026-12-05): the weight packed once into 48-column panels, each thread
prefetching its next panel while it works through one (cpu_linear.cpp says why and how). At
decode sizes oneDNN waited on the weight coming from memory: SmolLM2-135M's four layer linears,
30 layers' own weights, on the 2-core Xeon with AMX (benchmarks/linear_panels.py), 64 rows
oneDNN ~200 GFLOP/s against the panels' ~260, and level with it at 2,048 rows (~310). The sums
run in another order again (one sequential FMA chain over k), with errors of the same size.

bfloat16 on AMX, the tiles (default since 2026-12-06): the weight packed once into 16-column
panels in AMX's pair layout, 2 x 2 tiles (32 rows x 32 columns) at a time, the pair of panels
two ahead prefetched, each block's conversion to bf16 done while the next block's tiles compute,
and past 64 rows a thread's panels taken in L2-sized chunks (cpu_linear_amx.cpp). SmolLM2's
layer linears, each layer its own weights (benchmarks/linear_panels.py --dtype bfloat16), against
oneDNN: ~1,150 / ~800 GFLOP/s at 64 rows, ~1,900 / ~1,800 at 256, ~2,260 / ~2,480 at 2,048;
the LM head level or ahead but at 96-128 rows (~1,900 / ~2,050). float32 sums, one rounding to
bf16, in another order than oneDNN's (greedy paths part where they part from oneDNN's too).

bfloat16 (a CPU with avx512_bf16 or AMX): oneDNN's reordered weight. Measured on the 2-core
Xeon here without AMX (avx512_bf16 only), SmolLM2-135M's decode shapes at 64 rows: 1.65-1.69
against 1.84-2.12 ms (576 x 3072), 0.93-0.97 against 1.03-1.20 ms (1536 x 576), 27.6-28.7
against 31.8-32.1 ms (the 49,152-row lm_head), with outputs bit-identical to F.linear's.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BACKENDS = ("torch", "onednn", "panels")


def panels_available(dtype: torch.dtype = torch.float32) -> bool:
    """Folio's kernel for `dtype` is built for this CPU: the C++ library loads, with AVX-512
    (float32) or AMX (bfloat16, its tile state granted to this process)."""
    from folio.kernels import cpu_ops
    if dtype not in (torch.float32, torch.bfloat16) or not cpu_ops.available():
        return False
    ops = torch.ops.folio_cpu
    return bool(ops.linear_panels_available() if dtype == torch.float32 else ops.linear_tiles_available())


def linear_backend(device: torch.device, dtype: torch.dtype) -> str:
    name = os.environ.get("FOLIO_LINEAR_BACKEND", "").strip().lower()
    if name and name not in BACKENDS:
        raise ValueError(f"FOLIO_LINEAR_BACKEND must be one of {BACKENDS}, got {name!r}")
    usable = device.type == "cpu" and torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    if name == "onednn" and not usable:
        raise ValueError("FOLIO_LINEAR_BACKEND=onednn needs float32 (or, on a CPU with bf16 instructions, "
                         "bfloat16) weights on a CPU with oneDNN")
    panels = device.type == "cpu" and (name == "panels" or not name) and panels_available(dtype)
    if name == "panels" and not panels:
        raise ValueError("FOLIO_LINEAR_BACKEND=panels needs float32 weights on a CPU with AVX-512, or bfloat16 "
                         "on one with AMX, and a C++ compiler")
    return name or ("panels" if panels else "onednn" if usable else "torch")


class Linear:
    """A frozen linear layer. The oneDNN and panels paths keep only their packed copy of
    the weight (the plain one is dropped, so weights are not held twice)."""

    _packed = None  # oneDNN's reordered weight
    _panels = None  # cpu_linear.cpp's panels, or cpu_linear_amx.cpp's tiles (bfloat16)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.backend = backend
        self.weight = None
        if backend == "onednn":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        elif backend == "panels":
            tiles = weight.dtype == torch.bfloat16
            self._panels = (torch.ops.folio_cpu.pack_linear_tiles if tiles else torch.ops.folio_cpu.pack_linear_weight)(
                weight)
            self._run = torch.ops.folio_cpu.linear_tiles if tiles else torch.ops.folio_cpu.linear_panels
            self.bias = None if bias is None else bias.contiguous()
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:  # any row count: the kernel keeps no state per shape
            return self._run(x, self._panels, self.out_features, self.bias)
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.out_features)
        padded = row_bucket(rows)
        x = x.contiguous() if padded == rows else F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return out if padded == rows else out[:rows]


def row_bucket(rows: int) -> int:
    """The row count the oneDNN path runs `rows` as: exact up to 16, then rounded up to a
    multiple of 8 up to 256, and above that to 16 steps per power of two (at most 1/16 more
    rows, which is what a compute-bound prefill pays; small batches are bound by reading the
    weight, where 7 extra rows cost next to nothing). 94 buckets up to 2,048 rows.

    Why: oneDNN keeps state for every input shape it has seen (the primitive cache and
    ideep's LRU, 1,024 entries each, both holding each primitive). Measured on the 2-core
    Xeon here: ~0.8 MB per new row count on a 2816 x 512 weight, 4.5 GB for row counts
    1..512 over the tiny Llama's five weight shapes, and an engine's batch row count takes
    every value (decode batches, prefill chunks): a worker grew without end. With buckets a
    worker sees a bounded set of shapes, early on (benchmarks/memory_growth.py).
    """
    if rows <= 16:
        return rows
    step = 8 if rows <= 256 else 1 << ((rows - 1).bit_length() - 5)
    return -(-rows // step) * step


def warm_row_buckets(layers, max_rows: int) -> int:
    """Run each distinct oneDNN weight shape among `layers` (Linear, or (Linear, its own
    max rows)) once at every bucket up to `max_rows`, capped at WARM_ROWS_MAX, so the state
    oneDNN keeps per shape is made at load, before serving: a worker's memory then stays
    flat under any batch mix, and no request pays a first-time primitive build. Larger row
    counts are left to their first call (their state is small: ~0.4 MB each, measured).
    Returns the calls made."""
    seen: dict[tuple, tuple[Linear, int]] = {}
    for item in layers:
        lin, cap = item if isinstance(item, tuple) else (item, max_rows)
        if lin._packed is None:
            continue
        key = (tuple(lin._packed.shape), lin.bias is not None)
        seen[key] = (lin, max(cap, seen.get(key, (lin, 0))[1]))
    calls = 0
    with torch.inference_mode():
        for lin, cap in seen.values():
            top = min(cap, max_rows, WARM_ROWS_MAX)
            if top < 1:
                continue
            x = torch.zeros(top, lin._packed.shape[1])
            for r in sorted({row_bucket(r) for r in range(1, top + 1)}):
                lin(x[:r])
                calls += 1
    return calls


WARM_ROWS_MAX = 2048  # buckets above it cost the most to run; their state is made on first use
