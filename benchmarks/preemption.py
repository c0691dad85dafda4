"""Preemption under KV oversubscription: swap vs recompute vs auto, block sizes 8-64.

All requests are queued at start and together need ~3x the device KV blocks, so
the engine must preempt. Per (mode, block size): output tokens/s, normalized
latency (end-to-end latency / output tokens, the PagedAttention paper's metric;
mean and p99), preemptions by mode, bytes swapped, and the swap bandwidth achieved
against a plain torch copy of the same bytes on this machine (target >= 50 %).

    python benchmarks/preemption.py --model models/tiny-llama-8l [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from folio.worker import LLM, SamplingParams  # noqa: E402
from folio.worker.models.config import ModelConfig  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(min(max(rng.lognormvariate(4.2, 0.6), 16), 384))
        o = int(min(max(rng.lognormvariate(4.6, 0.5), 32), 256))
        out.append(([rng.randrange(16, vocab) for _ in range(p)], o))
    return out


def plain_copy_bytes_per_s(chunk_bytes: int, total_bytes: int = 512 << 20) -> float:
    """A plain torch copy of the same bytes: `chunk_bytes` at a time (a swap's size) out
    of a buffer far larger than the CPU cache (as the KV cache is), into another."""
    n = max(chunk_bytes // 4, 1024)
    src = torch.randn(max(total_bytes // 4, 4 * n))
    dst = torch.zeros_like(src)  # pages touched: no first-write faults in the timing
    chunks = src.numel() // n
    t = time.perf_counter()
    for i in range(chunks):
        dst[i * n : (i + 1) * n].copy_(src[i * n : (i + 1) * n])
    return chunks * n * 4 / (time.perf_counter() - t)


def run(model: str, reqs, mode: str, block_size: int, kv_tokens: int) -> dict:
    llm = LLM(model, block_size=block_size, num_kv_blocks=kv_tokens // block_size, max_model_len=1024,
              preemption_mode=mode, num_cpu_blocks=4 * kv_tokens // block_size, enable_prefix_caching=False)
    eng = llm.engine
    llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.monotonic()
    for i, (p, o) in enumerate(reqs):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True, detokenize=False),
                        arrival_time=t0)
    norm = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                norm.append((out.metrics.finished_time - t0) / len(out.outputs[0].token_ids))
    elapsed = time.monotonic() - t0
    st = eng.stats()
    eng.check_invariants()
    out_tokens = sum(o for _, o in reqs)
    swap_bps = st.swap_bytes / st.swap_seconds if st.swap_seconds > 0 else None
    return {
        "mode": mode, "block_size": block_size, "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "normalized_latency_mean_s": round(statistics.fmean(norm), 4),
        "normalized_latency_p99_s": round(sorted(norm)[min(len(norm) - 1, int(0.99 * len(norm)))], 4),
        "preemptions": st.preemptions_by_mode, "recomputed_tokens": st.num_recomputed_tokens,
        "swapped_out_blocks": st.swapped_out_blocks, "swapped_in_blocks": st.swapped_in_blocks,
        "swap_bytes": st.swap_bytes, "swap_seconds": round(st.swap_seconds, 4),
        "swap_bytes_per_s": swap_bps,
        "swap_calls": st.swap_calls,
        "swap_vs_plain_copy": round(swap_bps / plain_copy_bytes_per_s(st.swap_bytes // st.swap_calls), 3)
        if swap_bps else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--oversubscription", type=float, default=3.0, help="KV demand / device KV")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mc = ModelConfig.from_dir(args.model)
    n = args.requests or (12 if args.quick else 48)
    reqs = workload(n, mc.vocab_size, seed=0)
    demand = sum(len(p) + o for p, o in reqs)
    kv_tokens = max(int(demand / args.oversubscription), max(len(p) + o for p, o in reqs) + 64)
    kv_tokens -= kv_tokens % 64
    print(f"{n} requests, KV demand {demand} tokens, device KV {kv_tokens} tokens "
          f"({demand / kv_tokens:.1f}x oversubscribed)", flush=True)
    block_sizes = [16] if args.quick else [8, 16, 32, 64]
    rows = []
    for bs in block_sizes:
        for mode in ("swap", "recompute", "auto"):
            r = run(args.model, reqs, mode, bs, kv_tokens)
            print(r, flush=True)
            rows.append(r)
    doc = {"benchmark": "preemption", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
           "model": args.model, "requests": n, "kv_demand_tokens": demand, "device_kv_tokens": kv_tokens,
           "results": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    os.makedirs(RESULTS, exist_ok=True)
    out = args.out or os.path.join(RESULTS, "preemption_quick.json" if args.quick else "preemption.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print("\n| block | mode | tok/s | norm. latency mean / p99 (s/token) | preemptions swap / recompute "
          "| swapped MiB | swap / plain copy |\n|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{100 * r['swap_vs_plain_copy']:.0f} %" if r["swap_vs_plain_copy"] else "n/a"
        print(f"| {r['block_size']} | {r['mode']} | {r['output_tokens_per_s']} | {r['normalized_latency_mean_s']} / "
              f"{r['normalized_latency_p99_s']} | {r['preemptions']['swap']} / {r['preemptions']['recompute']} | "
              f"{r['swap_bytes'] / 2**20:.1f} | {ratio} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
