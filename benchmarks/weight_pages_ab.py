"""The linear layers' packed weights on 4 KB pages against the same weights on 2 MB pages,
decode steps alternated in one process: is it worth moving oneDNN's weights onto huge pages, as
worker/hugepages.py does for the KV cache? (Measured: no, README "Weights on huge pages".)

    python benchmarks/weight_pages_ab.py --model DIR_OR_GGUF [--dtype bfloat16] [--rounds 8] [--out FILE.json]

The engine is loaded as it is (its packed weights where oneDNN put them: on 4 KB pages where
/sys/kernel/mm/transparent_hugepage/enabled is "madvise"); every linear layer's weight is then
packed a second time, and the memory mapped for that copy (the new parts of the process's
mappings) is collapsed onto huge pages (MADV_COLLAPSE; `huge_copy_collapsed_bytes` says how much). `--batch` requests of
`--context` random tokens are prefilled, and each round times `--steps` decode steps on one
copy and then on the other (A B, then B A), switching by swapping the layers' packed tensors:
the same process, the same KV cache and the same requests, so the host's drift between
processes does not enter. Prints and writes the median step of each side per round and their
ratio (huge / small; < 1: huge pages faster).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import add_random_requests, prefill_all  # noqa: E402


HUGE_PAGE, MADV_HUGEPAGE, MADV_COLLAPSE = 2 << 20, 14, 25  # Linux's (Python's mmap has no MADV_COLLAPSE)


def anonymous_ranges() -> list[tuple[int, int]]:
    """This process's private anonymous mappings and its heap, as (start, end)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if fields[1].startswith("rw") and (len(fields) == 5 or fields[5] == "[heap]"):
                out.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return out


def collapse(ranges: list[tuple[int, int]]) -> int:
    """Puts the 2 MB-aligned parts of `ranges` on huge pages at once (Linux 6.1+); the bytes moved."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in ranges:
        a, b = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        if b - a >= HUGE_PAGE and libc.madvise(a, b - a, MADV_HUGEPAGE) == 0:
            done += (b - a) if libc.madvise(a, b - a, MADV_COLLAPSE) == 0 else 0
    return done


def new_ranges(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the `after` ranges that no `before` range covers (a heap that grew: its new top)."""
    out = []
    for lo, hi in after:
        parts = [(lo, hi)]
        for a, b in before:
            parts = [q for s, e in parts for q in ([(s, e)] if b <= s or e <= a else [(s, a), (b, e)]) if q[0] < q[1]]
        out += parts
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    from folio.kernels import linear
    from folio.worker import LLM

    plain: dict[int, torch.Tensor] = {}  # the dense weight of each layer, to pack it again
    init = linear.Linear.__init__

    def keep(self, weight, bias, backend):
        init(self, weight, bias, backend)
        plain[id(self)] = weight

    linear.Linear.__init__ = keep
    llm = LLM(args.model, dtype=args.dtype, block_size=16, max_model_len=2048, max_num_seqs=256,
              num_kv_blocks=args.batch * (args.context + 4 * args.rounds * (args.steps + 1) + 48) // 16 + 64,
              enable_prefix_caching=False)
    linear.Linear.__init__ = init
    model = llm.engine.runner.model
    layers = [lin for lw in model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [model.lm_head]
    assert all(lin._packed is not None for lin in layers), "the oneDNN path packs the weights: nothing to compare"
    small = [lin._packed for lin in layers]
    # copy B where malloc puts it (mostly the heap's new top: the memory of the load's temporaries
    # was handed back), then only what was mapped for it collapsed: weights_on_huge_pages()
    # would move copy A's pages too
    before = anonymous_ranges()
    huge = [torch.ops.mkldnn._reorder_linear_weight(plain[id(lin)]) for lin in layers]
    collapsed = collapse(new_ranges(before, anonymous_ranges()))
    plain.clear()
    eng = llm.engine
    add_random_requests(eng, args.batch, args.context, 4 * args.rounds * (args.steps + 1) + 16)
    prefill_all(eng)

    def timed(packed: list) -> float:
        for lin, p in zip(layers, packed):
            lin._packed = p
        eng.step()  # the first step on the other copy: not timed
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    rounds = []
    for r in range(args.rounds):
        a, b = (timed(small), timed(huge)) if r % 2 == 0 else reversed((timed(huge), timed(small)))
        rounds.append({"small_pages_ms": round(a, 2), "huge_pages_ms": round(b, 2), "ratio": round(b / a, 3)})
        print(f"round {r}: 4 KB pages {a:.1f} ms, 2 MB pages {b:.1f} ms, ratio {b / a:.3f}", flush=True)
    ratios = [x["ratio"] for x in rounds]
    doc = {"benchmark": "weight_pages_ab", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model,
           "dtype": args.dtype, "batch": args.batch, "context": args.context, "steps_per_side": args.steps,
           "command": " ".join(["python"] + sys.argv), "huge_copy_collapsed_bytes": collapsed,
           "rounds": rounds, "median_ratio": statistics.median(ratios),
           "huge_faster_in": f"{sum(x < 1 for x in ratios)}/{len(ratios)}"}
    print(json.dumps({k: doc[k] for k in ("median_ratio", "huge_faster_in", "huge_copy_collapsed_bytes")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
