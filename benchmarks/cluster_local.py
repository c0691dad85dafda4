"""The local cluster end to end: `folio serve`'s cluster (Ray workers, embedded Redis,
router, coordinator) on a tiny model, driven by a burst of requests.

    python benchmarks/cluster_local.py --model models/tiny-llama-8l [--workers 2] [--requests 32]

Half the burst is sent to worker w0 on purpose, with KV blocks sized so that w0 is
oversubscribed: requests are swapped out there and the coordinator resumes them on the
other worker. Checks every greedy output against the offline engine, and reports
throughput, TTFT and end-to-end latency, swaps and migrations.
Results: benchmarks/results/cluster_local.json (make run writes cluster_local_quick.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from folio.cluster.launcher import ClusterConfig, FolioCluster  # noqa: E402
from folio.worker import LLM, SamplingParams  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q / 100 * len(xs)), len(xs) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=64, help="per worker, of 16 tokens")
    ap.add_argument("--router", default="least-loaded")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cluster_local.json"))
    args = ap.parse_args()

    rng = random.Random(0)
    from folio.worker.detokenizer import load_tokenizer  # a checkpoint directory or a GGUF file

    vocab = load_tokenizer(args.model).vocab_size
    work = [([rng.randrange(16, vocab) for _ in range(rng.randint(16, 128))], rng.randint(32, 128))
            for _ in range(args.requests)]
    engine = dict(block_size=16, num_kv_blocks=args.kv_blocks, max_model_len=512, preemption_mode="swap",
                  num_cpu_blocks=4 * args.kv_blocks)
    cluster = FolioCluster(ClusterConfig(model=args.model, num_workers=args.workers, engine_args=engine,
                                         router=args.router, namespace="local")).start()
    try:
        async def one(i, prompt, n):
            req = GenerateRequest(request_id=f"q{i}", prompt_token_ids=prompt,
                                  params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                        detokenize=False))
            t0 = time.perf_counter()
            first, tokens, workers = None, [], set()
            async for chunk in cluster.router.generate(req, worker_id="w0" if i % 2 == 0 else None):
                if first is None and chunk.deltas and chunk.deltas[0].token_ids:
                    first = time.perf_counter() - t0
                tokens += chunk.deltas[0].token_ids if chunk.deltas else []
                workers.add(chunk.worker_id)
            return tokens, first, time.perf_counter() - t0, workers

        async def burst():
            return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(work)))
        t0 = time.perf_counter()
        results = asyncio.run(burst())
        wall = time.perf_counter() - t0
        import ray

        stats = {w: ray.get(h.stats.remote()) for w, h in cluster.workers.items()}
        coord = ray.get(cluster.coordinator.stats.remote()) if cluster.coordinator is not None else None  # 1 worker: none
    finally:
        cluster.shutdown(grace_s=5)

    offline = LLM(args.model, **engine).generate([p for p, _ in work], [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for _, n in work])
    identical = sum(r[0] == o.token_ids for r, o in zip(results, offline))
    out_tokens = sum(len(r[0]) for r in results)
    doc = {
        "benchmark": "cluster_local", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "command": " ".join(["python"] + sys.argv), "workers": args.workers, "requests": args.requests,
        "kv_blocks_per_worker": args.kv_blocks, "kv_demand_blocks": sum(-(-(len(p) + n) // 16) for p, n in work),
        "identical_to_offline": f"{identical}/{len(work)}", "wall_s": round(wall, 2),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "ttft_s_p50": round(pct([r[1] for r in results], 50), 3), "ttft_s_p99": round(pct([r[1] for r in results], 99), 3),
        "e2e_s_p50": round(pct([r[2] for r in results], 50), 3), "e2e_s_p99": round(pct([r[2] for r in results], 99), 3),
        "streams_that_moved_worker": sum(len(r[3]) > 1 for r in results),
        "swap_preemptions": {w: s["preemptions_by_mode"]["swap"] for w, s in stats.items()},
        "migrations_in": {w: s["num_migrations_in"] for w, s in stats.items()},
        "coordinator": coord,
    }
    print(json.dumps(doc, indent=2))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    if identical != len(work):
        sys.exit("cluster outputs differ from the offline engine")


if __name__ == "__main__":
    main()
