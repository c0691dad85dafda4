"""Router and coordinator under a high request rate: a simulated cluster of H200 workers.

    python benchmarks/cluster_sim.py [--workers 16] [--rate 200] [--duration 10]

16 simulated H200 workers serving Llama-3-8B (worker/sim_engine.py: Folio's own
scheduler and block manager, step times from a roofline model), with the real
worker actor code, router, coordinator and a real Redis, all in this process.
Workload: Poisson arrivals; 64 shared system prompts of 512 tokens plus a unique
suffix (32-512 tokens); 64-256 output tokens. For each routing policy it reports
the router's decisions per second (offered, and the most one router makes back to
back), the time a decision adds to a request (p50 / p99) beside one turn of the event loop
that the router shares with the simulated workers (p50 / p99), TTFT and end-to-end
latency, prefix-cache hit rate, preemptions and coordinator moves. The workers'
KV is sized down (--kv-blocks) so the load oversubscribes it and the coordinator works.
Results: benchmarks/results/cluster_sim.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from folio.cluster.policies import POLICIES  # noqa: E402
from folio.cluster.sim.cluster import SimCluster  # noqa: E402
from folio.worker import SamplingParams  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402

VOCAB = 128256


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q / 100 * len(xs)), len(xs) - 1)] if xs else None


def make_workload(n, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(512)] for _ in range(64)]
    return [(rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(32, 512))], rng.randint(64, 256))
            for _ in range(n)]


async def run_policy(policy, args):
    cluster = await SimCluster(args.workers, policy=policy, namespace=f"bench-{policy}",
                               num_kv_blocks=args.kv_blocks, max_num_seqs=256).start()
    try:
        router = cluster.router
        rng = random.Random(1)
        n = int(args.rate * args.duration)
        work = make_workload(n)
        ttft, e2e, failed = [], [], 0

        async def one(i, prompt, max_tokens):
            nonlocal failed
            t0 = time.perf_counter()
            first = None
            req = GenerateRequest(request_id=f"{policy}-{i}", prompt_token_ids=prompt,
                                  params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            try:
                async for chunk in router.generate(req):
                    if first is None and any(d.token_ids for d in chunk.deltas):
                        first = time.perf_counter() - t0
            except Exception:
                failed += 1
                return
            ttft.append(first)
            e2e.append(time.perf_counter() - t0)

        turns, loading = [], True

        async def loop_turns():
            # how long one turn of this (shared) event loop takes under the load: a decision
            # that awaits Redis once (prefix-aware) waits about that long for its reply
            while loading:
                t = time.perf_counter()
                await asyncio.sleep(0)
                turns.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        before = await cluster.stats()
        lag_probe = asyncio.create_task(loop_turns())
        t_start = time.perf_counter()
        tasks = []
        due = 0.0  # arrival times on an absolute schedule: a late wake-up does not lower the rate
        for i, (prompt, m) in enumerate(work):
            tasks.append(asyncio.create_task(one(i, prompt, m)))
            due += rng.expovariate(args.rate)
            await asyncio.sleep(max(due - (time.perf_counter() - t_start), 0.0))
        offered_s = time.perf_counter() - t_start
        loading = False  # the decisions are made: measured while arrivals came
        await asyncio.gather(*tasks, lag_probe)
        wall = time.perf_counter() - t_start
        decisions = list(router.decision_seconds)
        after = await cluster.stats()

        # back to back: how many decisions one router makes per second on this machine
        router.decision_seconds.clear()
        t0 = time.perf_counter()
        probes = make_workload(2000, seed=7)
        for i, (prompt, m) in enumerate(probes):
            await router.pick(GenerateRequest(request_id=f"probe{i}", prompt_token_ids=prompt,
                                              params=SamplingParams(max_tokens=m)))
        max_rate = len(probes) / (time.perf_counter() - t0)
        for w in cluster.workers.values():
            await w.check_invariants()

        def total(key):
            return sum(after[w][key] - before[w][key] for w in after)
        engines = [w.engine for w in cluster.workers.values()]
        hits, queries = total("prefix_cache_hits"), total("prefix_cache_queries")
        gen_tokens = total("num_generated_tokens")
        per_worker = sorted(after[w]["num_generated_tokens"] - before[w]["num_generated_tokens"] for w in after)
        return {
            "policy": policy, "requests": n, "completed": len(e2e), "failed": failed,
            "offered_rate_req_s": round(n / offered_s, 1), "wall_s": round(wall, 2),
            "output_tokens_per_s": round(gen_tokens / wall, 1),
            "router_decisions_per_s_offered": round(len(decisions) / offered_s, 1),
            "router_decisions_per_s_max": round(max_rate, 1),
            "router_decision_ms_p50": round(1e3 * pct(decisions, 50), 3),
            "router_decision_ms_p99": round(1e3 * pct(decisions, 99), 3),
            "event_loop_turn_ms_p50": round(1e3 * pct(turns, 50), 3),
            "event_loop_turn_ms_p99": round(1e3 * pct(turns, 99), 3),
            "ttft_ms_p50": round(1e3 * pct(ttft, 50), 1), "ttft_ms_p99": round(1e3 * pct(ttft, 99), 1),
            "e2e_s_p50": round(pct(e2e, 50), 3), "e2e_s_p99": round(pct(e2e, 99), 3),
            "prefix_cache_hit_rate": round(hits / queries, 3) if queries else None,
            "preemptions": total("num_preemptions"), "swapped_out_blocks": total("swapped_out_blocks"),
            "coordinator_moves": cluster.coordinator.stats()["moves"],
            "coordinator_failed_moves": cluster.coordinator.stats()["failed_moves"],
            "tokens_per_worker_min_max": [per_worker[0], per_worker[-1]],
            "sim_lag_s_mean_per_worker": round(statistics.mean(e.runner.lag_seconds for e in engines), 3),
        }
    finally:
        await cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    ap.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks (of 16 tokens) per simulated worker")
    ap.add_argument("--policy", choices=POLICIES, action="append")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cluster_sim.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]  # the machine is shared: how busy it was, beside the figures
    results = []
    for policy in args.policy or list(POLICIES):
        r = asyncio.run(run_policy(policy, args))
        print(json.dumps(r), flush=True)
        results.append(r)
    doc = {"benchmark": "cluster_sim", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_average_1m_start_end": [round(load_before, 1), round(os.getloadavg()[0], 1)]},
           "workers": args.workers, "gpu": "H200 (simulated)", "model": "llama-3-8b (simulated)",
           "kv_blocks_per_worker": args.kv_blocks, "command": " ".join(["python"] + sys.argv), "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
