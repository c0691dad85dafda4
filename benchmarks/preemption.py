"""Preemption under KV oversubscription: swap vs recompute vs auto, block sizes 8-64.

All requests are queued at start and together need ~3x the device KV blocks, so
the engine must preempt. Per (KV cache layout, block size, mode): output tokens/s,
normalized latency (end-to-end latency / output tokens, the PagedAttention paper's
metric; mean and p99), preemptions by mode, bytes swapped, and the swap bandwidth
achieved against a plain torch copy of the same bytes on this machine (target >= 50 %):
paired (after each step that swapped, one contiguous copy of that many bytes from cold
memory) and streaming (chunks of the mean swap size back to back).

    python benchmarks/preemption.py --model models/tiny-llama-8l --requests 24 --rounds 3 [--quick]
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
from folio.worker.models.model_config import ModelConfig  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(min(max(rng.lognormvariate(4.2, 0.6), 16), 384))
        o = int(min(max(rng.lognormvariate(4.6, 0.5), 32), 256))
        out.append(([rng.randrange(16, vocab) for _ in range(p)], o))
    return out


_PLAIN: list[torch.Tensor] = []  # the plain copies' source and destination: 512 MiB each, allocated once


def _plain_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    if not _PLAIN:
        _PLAIN.append(torch.randn((512 << 20) // 4))
        _PLAIN.append(torch.zeros_like(_PLAIN[0]))  # pages touched: no first-write faults in the timing
    return _PLAIN[0], _PLAIN[1]


class PairedPlainCopy:
    """The comparison the target is set against: after every step that swapped, one plain
    `copy_` of the same number of bytes, contiguous, between two 512 MiB buffers. The
    offset moves on each time, so neither side is in the CPU cache (as swapped KV blocks
    are not), and it runs at the same point of the engine's cycle as the swap did."""

    def __init__(self) -> None:
        self.src, self.dst = _plain_buffers()
        self.pos = 0
        self.bytes = 0
        self.seconds = 0.0

    def copy(self, nbytes: int) -> None:
        n = nbytes // 4
        if self.pos + n > self.src.numel():
            self.pos = 0
        t = time.perf_counter()
        self.dst[self.pos : self.pos + n].copy_(self.src[self.pos : self.pos + n])
        self.seconds += time.perf_counter() - t
        self.bytes += n * 4
        self.pos += n


def streaming_copy_bytes_per_s(chunk_bytes: int, passes: int = 3) -> float:
    """A plain copy's best case: `chunk_bytes` at a time, back to back through the 512 MiB
    buffers (one sequential stream the hardware prefetches), median of `passes` passes."""
    src, dst = _plain_buffers()
    n = max(chunk_bytes // 4, 1024)
    chunks = src.numel() // n
    speeds = []
    for _ in range(passes):
        t = time.perf_counter()
        for i in range(chunks):
            dst[i * n : (i + 1) * n].copy_(src[i * n : (i + 1) * n])
        speeds.append(chunks * n * 4 / (time.perf_counter() - t))
    return statistics.median(speeds)


def run(model: str, reqs, mode: str, block_size: int, kv_tokens: int, layout: str) -> dict:
    llm = LLM(model, block_size=block_size, num_kv_blocks=kv_tokens // block_size, max_model_len=1024,
              preemption_mode=mode, num_cpu_blocks=4 * kv_tokens // block_size, enable_prefix_caching=False,
              kv_cache_layout=layout)
    eng = llm.engine
    llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.monotonic()
    for i, (p, o) in enumerate(reqs):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True, detokenize=False),
                        arrival_time=t0)
    norm = []
    plain, swapped = PairedPlainCopy(), 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                norm.append((out.metrics.finished_time - t0) / len(out.outputs[0].token_ids))
        if eng.swap_bytes > swapped:
            plain.copy(eng.swap_bytes - swapped)  # outside the engine's timings (~0.1-0.3 ms a step)
            swapped = eng.swap_bytes
    elapsed = time.monotonic() - t0
    st = eng.stats()
    eng.check_invariants()
    out_tokens = sum(o for _, o in reqs)
    swap_bps = st.swap_bytes / st.swap_seconds if st.swap_seconds > 0 else None
    plain_bps = plain.bytes / plain.seconds if swap_bps else None
    streaming_bps = streaming_copy_bytes_per_s(st.swap_bytes // st.swap_calls) if swap_bps else None
    return {
        "layout": layout, "mode": mode, "block_size": block_size, "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "normalized_latency_mean_s": round(statistics.fmean(norm), 4),
        "normalized_latency_p99_s": round(sorted(norm)[min(len(norm) - 1, int(0.99 * len(norm)))], 4),
        "preemptions": st.preemptions_by_mode, "recomputed_tokens": st.num_recomputed_tokens,
        "swapped_out_blocks": st.swapped_out_blocks, "swapped_in_blocks": st.swapped_in_blocks,
        "swap_bytes": st.swap_bytes, "swap_seconds": round(st.swap_seconds, 4),
        "swap_bytes_per_s": swap_bps,
        "swap_calls": st.swap_calls,
        "plain_copy_bytes_per_s": plain_bps,
        "swap_vs_plain_copy": round(swap_bps / plain_bps, 3) if swap_bps else None,
        "streaming_copy_bytes_per_s": streaming_bps,
        "swap_vs_streaming_copy": round(swap_bps / streaming_bps, 3) if swap_bps else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--oversubscription", type=float, default=3.0, help="KV demand / device KV")
    ap.add_argument("--layouts", default="block_major,layer_major", help="KV cache layouts to compare")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every (block size, mode); the table shows medians")
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
    layouts = args.layouts.split(",")
    rows = []
    for rnd in range(args.rounds):
        for bs in block_sizes:
            for mode in ("swap", "recompute", "auto"):
                for layout in layouts if rnd % 2 == 0 else layouts[::-1]:  # alternated: the machine drifts
                    r = {"round": rnd, **run(args.model, reqs, mode, bs, kv_tokens, layout)}
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
    print(f"\nmedians of {args.rounds} round(s); swap GB/s and its ratios: median (each round)")
    print("\n| layout | block | mode | tok/s | norm. latency mean / p99 (s/token) | preemptions swap / recompute "
          "| swapped MiB | swap GB/s | swap / paired plain copy | swap / streaming copy |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for layout, bs, mode in ((x, b, m) for x in layouts for b in block_sizes for m in ("swap", "recompute", "auto")):
        rs = [r for r in rows if r["layout"] == layout and r["block_size"] == bs and r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("output_tokens_per_s", "normalized_latency_mean_s", "normalized_latency_p99_s")}
        def spread(key: str, scale: float, fmt: str) -> str:
            xs = [scale * r[key] for r in rs if r[key]]
            return f"{statistics.median(xs):{fmt}} ({', '.join(f'{x:{fmt}}' for x in xs)})" if xs else "n/a"

        gbps = spread("swap_bytes_per_s", 1e-9, ".1f")
        ratio, streaming = spread("swap_vs_plain_copy", 100, ".0f"), spread("swap_vs_streaming_copy", 100, ".0f")
        # preemptions and bytes: the same every round unless auto's measured rates chose differently
        counts = "; ".join(dict.fromkeys(f"{r['preemptions']['swap']} / {r['preemptions']['recompute']}"
                                         for r in rs))
        mib = "; ".join(dict.fromkeys(f"{r['swap_bytes'] / 2**20:.1f}" for r in rs))
        print(f"| {layout} | {bs} | {mode} | {med['output_tokens_per_s']:.1f} | "
              f"{med['normalized_latency_mean_s']:.4f} / {med['normalized_latency_p99_s']:.4f} | {counts} | {mib} "
              f"| {gbps} | {ratio} | {streaming} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
