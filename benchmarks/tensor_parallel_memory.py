"""Memory of a tensor-parallel engine over many requests: rank 0's and the follower's RSS
after each round of 50 requests of mixed lengths and sampling (greedy and seeded), with the
linear kernels warmed up as a server's engines are (warm_up=True, SERVER_DEFAULTS).

    python benchmarks/tensor_parallel_memory.py --model models/tiny-llama-8l [--rounds 24]

Writes benchmarks/results/tensor_parallel_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402

from folio.worker import LLM, SamplingParams  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--out", default=os.path.join(RESULTS, "tensor_parallel_memory.json"))
    args = ap.parse_args()
    llm = LLM(args.model, block_size=16, num_kv_blocks=512, num_cpu_blocks=128, tensor_parallel_size=2,
              warm_up=True)
    me, follower = psutil.Process(), psutil.Process(llm.engine.runner.followers[0].pid)
    rng = random.Random(0)
    rss = []
    t0 = time.time()
    try:
        for r in range(args.rounds):
            prompts = [[rng.randrange(16, 8000) for _ in range(rng.randint(2, 300))] for _ in range(50)]
            params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]), seed=r)
                      for _ in prompts]
            llm.generate(prompts, params)
            rss.append({"round": r + 1, "rank0_mib": me.memory_info().rss >> 20,
                        "follower_mib": follower.memory_info().rss >> 20})
            print(rss[-1], flush=True)
        llm.engine.check_invariants()
        leaked = llm.engine.num_kv_blocks - llm.engine.kv.num_free_blocks
    finally:
        llm.engine.runner.close()
    half = rss[len(rss) // 2:]
    doc = {"benchmark": "tensor_parallel_memory", "date": time.strftime("%Y-%m-%d"), "model": args.model,
           "requests": 50 * args.rounds, "seconds": round(time.time() - t0, 1), "kv_blocks_leaked": leaked,
           "rank0_mib_first_last": [rss[0]["rank0_mib"], rss[-1]["rank0_mib"]],
           "follower_mib_first_last": [rss[0]["follower_mib"], rss[-1]["follower_mib"]],
           "second_half_spread_mib": {k: max(x[k] for x in half) - min(x[k] for x in half)
                                      for k in ("rank0_mib", "follower_mib")},
           "rounds": rss}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps({k: v for k, v in doc.items() if k != "rounds"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
