"""GPU kernel benchmark (needs CUDA; written for a lent H200).

1. Correctness on the GPU: the Triton kernels against the torch reference on mixed
   batches (decode + chunked prefill + prefill), fp32 / fp16 / bf16, several block
   sizes and head dims.
2. Decode attention at batch 1-256 x context 512-32k (Llama-3-8B shapes: 32 query
   heads, 8 kv heads, head_dim 128, fp16, block_size 16, random block tables):
   median time with CUDA events after warm-up, achieved KV bytes/s against a
   measured device-to-device copy, and the same attention on contiguous KV with
   torch.nn.functional.scaled_dot_product_attention as the non-paged reference.

3. The same decode attention on the engine's default block-major cache (each layer a
   strided view of [blocks, layers, k|v, ...]; 4 layers allocated) against per-layer
   contiguous caches, at batch <= 64 and context <= 8k.
4. Swap (issue 4): `swap_blocks` of 256 blocks in mixed runs between the device cache and a
   pinned host cache, Llama-3-8B shapes (32 layers), block-major vs layer-major, against one
   plain pinned copy of the same bytes, both directions.

    python benchmarks/kernels_gpu.py [--quick] [--out benchmarks/results/kernels_gpu.json]

Targets (issue 3): decode >= 70 % of copy bandwidth at batch >= 32 and context >= 2k;
paged within 1.3x of contiguous SDPA time. Issue 4: swap >= 50 % of the plain copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cuda_time(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median seconds of fn() over `reps` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes moved (read + write) per second by a plain device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / t


def check_correctness(ops_triton, ref) -> list[dict]:
    """Each dtype x (block size, head dim, GQA): a mixed batch (decode, chunked prefill, prefill)
    as the launcher picks its grid, the same batch split into 5 context ranges (forced), and a
    decode-only batch, which the launcher splits by itself (the flash-decoding path)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    variants = {"mixed": ([1, 1, 37, 128, 1, 300], [1000, 17, 100, 128, 4097, 300], None),
                "mixed, 5 splits": ([1, 1, 37, 128, 1, 300], [1000, 17, 100, 128, 4097, 300], 5),
                "decode, auto split": ([1, 1, 1, 1], [1000, 17, 4097, 300], None)}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for block_size, head_dim, gqa in ((8, 64, 1), (16, 80, 2), (32, 96, 4), (64, 128, 8), (16, 128, 4)):
            for variant, (q_lens, ctx_lens, splits) in variants.items():
                kv_heads = 2
                nb = [-(-c // block_size) for c in ctx_lens]
                num_blocks = sum(nb) + 10
                kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
                vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to("cuda", dtype)
                perm = torch.randperm(num_blocks, generator=gen).tolist()
                tables = torch.zeros(len(ctx_lens), max(nb), dtype=torch.int32)
                for s, n in enumerate(nb):
                    tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
                q = torch.randn(sum(q_lens), kv_heads * gqa, head_dim, generator=gen).to("cuda", dtype)
                qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
                tables = tables.cuda()
                scale = head_dim ** -0.5
                kw = {} if splits is None else {"num_splits": splits}
                got = ops_triton.paged_attention(q, kc, vc, tables, lens, qsl, scale,
                                                 out=torch.full_like(q, float("nan")), **kw)
                want = ref.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), lens.cpu(), qsl.cpu(), scale)
                err = (got.float().cpu() - want.float()).abs().max().item()
                tol = 2e-4 if dtype == torch.float32 else (2e-3 if dtype == torch.float16 else 2e-2)
                out.append({"dtype": str(dtype).split(".")[-1], "block_size": block_size, "head_dim": head_dim,
                            "gqa": gqa, "variant": variant, "max_abs_err": err, "nan": bool(got.isnan().any()),
                            "ok": err < tol})
                print(out[-1], flush=True)
    return out


def decode_bench(ops_triton, batch: int, ctx: int, block_size: int = 16, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, dtype=torch.float16, block_major_layers: int = 0) -> dict:
    nb = -(-ctx // block_size)
    num_blocks = batch * nb
    if block_major_layers:  # layer 1's K and V as strided views of a block-major cache, as the engine has them
        cache = torch.randn(num_blocks, block_major_layers, 2, block_size, kv_heads, head_dim, device="cuda",
                            dtype=dtype)
        kc, vc = cache[:, 1, 0], cache[:, 1, 1]
    else:
        kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, nb)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    from folio.kernels.attention_plan import AttentionPlan
    from folio.kernels.paged_attention import num_splits_for, sm_count

    plan = AttentionPlan([], [], max_query_len=1, max_seq_len=ctx)  # as the engine's plan has them
    splits = num_splits_for(sm_count(q.device), batch * kv_heads, ctx, 1)
    scale = head_dim ** -0.5
    t_paged = cuda_time(lambda: ops_triton.paged_attention(q, kc, vc, tables, lens, qsl, scale, plan=plan))
    # the kernel as it was before the context split (2026-12-04): one program per (seq, kv head),
    # 16-token steps at block size 16
    t_nosplit = cuda_time(lambda: ops_triton.paged_attention(q, kc, vc, tables, lens, qsl, scale, plan=plan,
                                                             num_splits=1, block_n=max(16, min(64, block_size))))
    # contiguous reference: the same KV laid out [batch, kv_heads, ctx, head_dim]
    kcont = kc[tables.long()].view(batch, nb * block_size, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    vcont = vc[tables.long()].view(batch, nb * block_size, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    qs = q[:, :, None, :]
    t_sdpa = cuda_time(lambda: F.scaled_dot_product_attention(qs, kcont, vcont, scale=scale, enable_gqa=True))
    got = ops_triton.paged_attention(q, kc, vc, tables, lens, qsl, scale, plan=plan)
    want = F.scaled_dot_product_attention(qs, kcont, vcont, scale=scale, enable_gqa=True)[:, :, 0]
    err = (got.float() - want.float()).abs().max().item()
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * kc.element_size()
    del kc, vc, kcont, vcont
    return {"batch": batch, "context": ctx, "block_major_layers": block_major_layers, "num_splits": splits,
            "paged_ms": t_paged * 1e3, "paged_before_split_ms": t_nosplit * 1e3, "sdpa_contiguous_ms": t_sdpa * 1e3,
            "paged_over_sdpa": t_paged / t_sdpa, "kv_bytes": kv_bytes, "paged_bytes_per_s": kv_bytes / t_paged,
            "max_abs_err_vs_sdpa": err}


def split_sweep(ops_triton, out_path: str) -> int:
    """Decode attention (Llama-3-8B shapes, fp16, block 16) at batch x context with the context
    split forced to 1, 2, 4, ... 32 ranges, beside what num_splits_for picks."""
    from folio.kernels.attention_plan import AttentionPlan
    from folio.kernels.paged_attention import num_splits_for, sm_count

    rows = []
    for ctx in (256, 512, 1024, 2048, 8192):
        for batch in (1, 8, 32, 64):
            nb = -(-ctx // 16)
            kc = torch.randn(batch * nb, 16, 8, 128, device="cuda", dtype=torch.float16)
            vc = torch.randn_like(kc)
            tables = torch.randperm(batch * nb, device="cuda", dtype=torch.int32).view(batch, nb)
            q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.float16)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            plan = AttentionPlan([], [], max_query_len=1, max_seq_len=ctx)
            ms = {n: 1e3 * cuda_time(lambda n=n: ops_triton.paged_attention(q, kc, vc, tables, lens, qsl, 0.088,
                                                                            plan=plan, num_splits=n))
                  for n in (1, 2, 4, 8, 16, 32) if n == 1 or ctx // n >= 64}
            best = min(ms, key=ms.get)
            rows.append({"batch": batch, "context": ctx, "ms_by_splits": ms, "best": best,
                         "policy": num_splits_for(sm_count(q.device), batch * 8, ctx, 1)})
            print(rows[-1], flush=True)
            del kc, vc
    with open(out_path, "w") as f:
        json.dump({"benchmark": "kernels_gpu --split-sweep", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


def swap_bench(device: str = "cuda", num_blocks: int = 1024, swapped: int = 256, layers: int = 32,
               block_size: int = 16, kv_heads: int = 8, head_dim: int = 128, dtype=torch.float16) -> list[dict]:
    """swap_blocks between a device cache and a pinned host cache, both layouts, both directions:
    `swapped` blocks in runs of 1-8 (a mix like preemption.py's), against a plain pinned copy of the
    same bytes. Each timing is the median of 10 calls, synchronized."""
    from folio.kernels.reference import swap_blocks

    gen = torch.Generator().manual_seed(0)
    pairs, dst = [], 0
    src_free = torch.randperm(num_blocks // 8, generator=gen).tolist()
    while len(pairs) < swapped:
        n = int(torch.randint(1, 9, (1,), generator=gen))
        s = 8 * src_free.pop()
        pairs += [(s + i, dst + i) for i in range(min(n, swapped - len(pairs)))]
        dst += n + 1  # host runs not adjacent either
    host_blocks = dst + 1
    pin = device == "cuda"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn()
        sync()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = []
    for layout in ("block_major", "layer_major"):
        def cache(n: int, **kw) -> torch.Tensor:
            if layout == "block_major":
                return torch.zeros(n, layers, 2, block_size, kv_heads, head_dim, dtype=dtype, **kw)
            return torch.zeros(layers, 2, n, block_size, kv_heads, head_dim, dtype=dtype, **kw).permute(2, 0, 1, 3, 4, 5)

        dev, host = cache(num_blocks, device=device), cache(host_blocks, pin_memory=pin)
        views = list(dev.unbind(0)), list(host.unbind(0))
        nbytes = len(pairs) * dev[0].numel() * dev.element_size()
        out_s = timed(lambda: swap_blocks(dev, host, pairs, *views))
        in_s = timed(lambda: swap_blocks(host, dev, [(h, d) for d, h in pairs], views[1], views[0]))
        plain_dev = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
        plain_host = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=pin)
        plain_out = timed(lambda: plain_host.copy_(plain_dev, non_blocking=True))
        plain_in = timed(lambda: plain_dev.copy_(plain_host, non_blocking=True))
        rows.append({"layout": layout, "blocks": len(pairs), "bytes": nbytes,
                     "swap_out_GBps": nbytes / out_s / 1e9, "swap_in_GBps": nbytes / in_s / 1e9,
                     "plain_out_GBps": nbytes / plain_out / 1e9, "plain_in_GBps": nbytes / plain_in / 1e9,
                     "out_vs_plain": plain_out / out_s, "in_vs_plain": plain_in / in_s})
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        del dev, host, views, plain_dev, plain_host
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "kernels_gpu.json"))
    ap.add_argument("--max-kv-gib", type=float, default=48.0, help="skip shapes whose KV exceeds this")
    ap.add_argument("--split-sweep", action="store_true",
                    help="only: decode attention at each forced number of context splits (the split policy's data)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA device; none is visible here", file=sys.stderr)
        return 2
    os.environ["FOLIO_ATTENTION_BACKEND"] = "triton"
    from folio.kernels import reference
    from folio.kernels.backend import get_ops

    ops = get_ops("cuda")
    t0 = time.time()
    if args.split_sweep:
        return split_sweep(ops, args.out)
    correctness = check_correctness(ops, reference)
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    batches = [1, 32, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [512, 2048, 32768] if args.quick else [512, 2048, 8192, 32768]
    rows = []
    for ctx in contexts:
        for batch in batches:
            kv_gib = 2 * batch * ctx * 8 * 128 * 2 / 2**30
            if kv_gib > args.max_kv_gib:
                continue
            r = decode_bench(ops, batch, ctx)
            r["fraction_of_copy_bw"] = r["paged_bytes_per_s"] / bw
            rows.append(r)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            torch.cuda.empty_cache()
    strided = []
    for ctx in [c for c in contexts if c <= 8192]:
        for batch in [b for b in batches if b <= 64]:
            r = decode_bench(ops, batch, ctx, block_major_layers=4)
            base = next(x for x in rows if x["batch"] == batch and x["context"] == ctx)
            r["over_per_layer_cache"] = r["paged_ms"] / base["paged_ms"]
            strided.append(r)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            torch.cuda.empty_cache()
    swaps = swap_bench(num_blocks=1024 if args.quick else 4096)
    big = [r for r in rows if r["batch"] >= 32 and r["context"] >= 2048]
    summary = {
        "correctness_ok": all(c["ok"] and not c["nan"] for c in correctness),
        "copy_bandwidth_GBps": bw / 1e9,
        "min_fraction_of_copy_bw_batch32_ctx2k": min((r["fraction_of_copy_bw"] for r in big), default=None),
        "max_paged_over_sdpa": max((r["paged_over_sdpa"] for r in rows), default=None),
        "max_speedup_of_split": max((r["paged_before_split_ms"] / r["paged_ms"] for r in rows), default=None),
        "max_block_major_over_per_layer": max((r["over_per_layer_cache"] for r in strided), default=None),
        "min_swap_vs_plain_block_major": min(min(r["out_vs_plain"], r["in_vs_plain"]) for r in swaps
                                             if r["layout"] == "block_major"),
        "seconds": time.time() - t0,
    }
    doc = {"benchmark": "kernels_gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform(),
           "shapes": {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float16", "block_size": 16},
           "correctness": correctness, "decode": rows, "decode_block_major": strided, "swap": swaps,
           "summary": summary}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0 if summary["correctness_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
