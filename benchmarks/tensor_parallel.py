"""Tensor parallelism on this CPU: the same model at tensor_parallel_size 1 and 2 (gloo),
A B B A, and the share of the step that rank 0 spends in the all-reduces and all-gathers.

On 2 shared cores TP=2 is not expected to be faster: both ranks share the cores the one-rank
engine had to itself, and every layer adds two all-reduces over loopback TCP. What this
measures is the cost of the sharded path (it is what a GPU node buys back with NVLink).

    python benchmarks/tensor_parallel.py --model models/tiny-llama-8l

Writes benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from folio.worker import LLM, SamplingParams  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WORKLOADS = {"batch 32 x 128 -> 64": (32, 128, 64), "one stream 128 -> 64": (1, 128, 64)}


def run(llm: LLM, n: int, prompt_len: int, out_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(16, 8000) for _ in range(prompt_len)] for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    e = llm.engine
    group = getattr(e.runner, "group", None)
    c0 = group.collective_seconds if group is not None else 0.0
    t0s = {k: getattr(e.timings, k) for k in ("forward", "prepare", "sample", "schedule", "postprocess")}
    s0 = e.timings.steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step_s = sum(getattr(e.timings, k) - v for k, v in t0s.items())
    coll = (group.collective_seconds - c0) if group is not None else 0.0
    return {"out_tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "steps": e.timings.steps - s0,
            "ms_per_step": round(1e3 * step_s / max(e.timings.steps - s0, 1), 2),
            "collective_share_of_step": round(coll / step_s, 3) if step_s else 0.0,
            "collective_ms_per_step": round(1e3 * coll / max(e.timings.steps - s0, 1), 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(RESULTS, "tensor_parallel.json"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    engines = {}
    for tp in (1, 2):
        torch.set_num_threads(max(cores // tp, 1))  # a TP=2 follower takes its share at start (tp_runner.py)
        engines[tp] = LLM(args.model, block_size=16, num_kv_blocks=2048, tensor_parallel_size=tp)
    results: dict = {name: {"tp1": [], "tp2": []} for name in WORKLOADS}
    try:
        for name, (n, p, o) in WORKLOADS.items():
            for tp in (1, 2):  # warm-up: kernels' per-shape state, the allocator
                torch.set_num_threads(max(cores // tp, 1))
                run(engines[tp], n, p, 8, seed=99)
            for i, tp in enumerate((1, 2, 2, 1)):
                torch.set_num_threads(max(cores // tp, 1))
                r = run(engines[tp], n, p, o, seed=i)
                results[name][f"tp{tp}"].append(r)
                print(name, f"tp{tp}", r, flush=True)
    finally:
        engines[2].engine.runner.close()
    summary = {}
    for name, by in results.items():
        t1 = sum(r["out_tok_s"] for r in by["tp1"]) / 2
        t2 = sum(r["out_tok_s"] for r in by["tp2"]) / 2
        share = sum(r["collective_share_of_step"] for r in by["tp2"]) / 2
        summary[name] = {"tp1_out_tok_s": round(t1, 1), "tp2_out_tok_s": round(t2, 1),
                         "tp2_over_tp1": round(t2 / t1, 3), "tp2_collective_share_of_step": round(share, 3)}
    doc = {"benchmark": "tensor_parallel", "date": time.strftime("%Y-%m-%d"), "model": args.model,
           "host": {"cpu": platform.processor() or platform.machine(), "cores": cores,
                    "torch": torch.__version__, "python": sys.version.split()[0]},
           "order": "A B B A (tp1 tp2 tp2 tp1) per workload, one process, both engines loaded",
           "threads": "tp1: all cores; tp2: cores / 2 per rank", "summary": summary, "passes": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
