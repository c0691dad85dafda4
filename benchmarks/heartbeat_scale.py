"""What a heartbeat costs at scale: simulated workers (Folio's scheduler and block manager,
worker/sim_engine.py) with 100,000 KV blocks and 1,000 running requests each, publishing to
a real Redis every 100 ms, all in this process.

    python benchmarks/heartbeat_scale.py [--workers 16] [--blocks 100000] [--requests 1000]

For each worker it measures, as CPU time of its step thread (time.pthread_getcpuclockid),
the share spent building and handing over heartbeats (of its CPU time, and of the wall time:
the step loop's time a real GPU step would use), and, on the same engine state, what
the previous heartbeat cost per beat (a copy of every cached block hash plus a summary of
every request). On Redis (INFO's total_net_input_bytes): bytes per heartbeat while decoding
and while idle, beside the number of prefix changes they carried and the size of one whole
prefix set. Results: benchmarks/results/heartbeat_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import redis  # noqa: E402

from folio.cluster.redis_server import EmbeddedRedis  # noqa: E402
from folio.cluster.state import WorkerPublisher  # noqa: E402
from folio.worker.actor import EngineWorker  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402
from folio.cluster.sim.roofline import Roofline  # noqa: E402
from folio.worker.sampling_params import SamplingParams  # noqa: E402
from folio.cluster.sim.runner import simulated_engine  # noqa: E402


def thread_cpu(t: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def old_beat_cost(e) -> float:
    """CPU seconds of what the previous heartbeat did on the step thread each beat."""
    t0 = time.thread_time()
    set(e.kv.pool.cached)
    e.request_summaries()
    sum(max(s.num_prompt_tokens - s.num_computed_tokens, 0) for s in e.live_sequences())
    return time.thread_time() - t0


def net_in(url: str) -> int:
    return int(redis.Redis.from_url(url).info("stats")["total_net_input_bytes"])


def snapshot(workers):
    return {w.worker_id: (thread_cpu(w._threads[0]), w._heartbeat.beat_cpu_seconds, w._heartbeat.num_published,
                          w._heartbeat.num_changes_sent, w.engine.num_steps) for w in workers}


def window(workers, url, seconds):
    a, b0 = snapshot(workers), net_in(url)
    time.sleep(seconds)
    b, b1 = snapshot(workers), net_in(url)
    per = {}
    for wid in a:
        cpu, beat, pubs, changes, steps = (y - x for x, y in zip(a[wid], b[wid]))
        per[wid] = {"step_thread_cpu_s": round(cpu, 3), "heartbeat_cpu_s": round(beat, 4),
                    "heartbeat_share": round(beat / cpu, 5) if cpu else None,
                    "heartbeat_share_of_wall": round(beat / seconds, 5), "heartbeats": pubs,
                    "prefix_changes": changes, "steps": steps}
    pubs = sum(p["heartbeats"] for p in per.values())
    return {"seconds": seconds, "heartbeats": pubs, "redis_bytes_in": b1 - b0,
            "redis_bytes_per_heartbeat": round((b1 - b0) / pubs, 1) if pubs else None,
            "prefix_changes_per_heartbeat": round(sum(p["prefix_changes"] for p in per.values()) / pubs, 1)
            if pubs else None,
            "heartbeat_share_max": max((p["heartbeat_share"] or 0) for p in per.values()),
            "heartbeat_share_mean": round(sum((p["heartbeat_share"] or 0) for p in per.values()) / len(per), 5),
            "heartbeat_share_of_wall_max": max(p["heartbeat_share_of_wall"] for p in per.values()),
            "workers": per}


async def main_async(args, url):
    rf = Roofline.named()
    eng = functools.partial(simulated_engine, rf, block_size=16, num_kv_blocks=args.blocks, num_cpu_blocks=0,
                            max_num_seqs=args.requests, max_num_batched_tokens=args.batched_tokens,
                            time_scale=args.time_scale, preemption_mode="recompute")
    pub = functools.partial(WorkerPublisher, url, "hb")
    workers = [EngineWorker(f"w{i}", eng, pub, heartbeat_s=0.1) for i in range(args.workers)]
    rng = random.Random(0)
    systems = [[rng.randrange(1, 128000) for _ in range(512)] for _ in range(64)]
    # each request ~ 512 + 256-768 prompt tokens, 1,000 of them: ~ 65 % of 100,000 blocks, growing while decoding
    tasks = []

    async def one(w, i):
        prompt = rng.choice(systems) + [rng.randrange(1, 128000) for _ in range(rng.randint(256, 768))]
        req = GenerateRequest(request_id=f"{w.worker_id}-{i}", prompt_token_ids=prompt,
                              params=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        async for _ in w.generate(req):
            pass
    for w in workers:
        tasks += [asyncio.create_task(one(w, i)) for i in range(args.requests)]
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.ramp_s:  # until every request is running (prefills done)
        loads = [await w.load() for w in workers]
        if all(lo.num_running == args.requests and lo.queued_tokens == 0 for lo in loads):
            break
        await asyncio.sleep(0.5)
    loads = [await w.load() for w in workers]
    decode = await asyncio.to_thread(window, workers, url, args.window_s)
    old = [await w._call(old_beat_cost) for w in workers]
    cached = [len(w.engine.kv.cached_block_hashes()) for w in workers]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)
    idle = await asyncio.to_thread(window, workers, url, min(args.window_s, 3.0))
    for w in workers:
        w.shutdown()
    beat_rate = 1 / 0.1
    return {"running_per_worker": [lo.num_running for lo in loads],
            "kv_usage_per_worker": [round(lo.kv_usage, 3) for lo in loads],
            "cached_blocks_per_worker": cached, "decode": decode, "idle": idle,
            "previous_heartbeat_cpu_ms_per_beat": [round(1e3 * x, 3) for x in old],
            "previous_heartbeat_share_estimate": [
                round(x * beat_rate * decode["seconds"] / decode["workers"][w.worker_id]["step_thread_cpu_s"], 4)
                if decode["workers"][w.worker_id]["step_thread_cpu_s"] else None for x, w in zip(old, workers)],
            "whole_prefix_set_bytes": max(cached) * 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=1000, help="running requests per worker")
    ap.add_argument("--max-tokens", type=int, default=6000, help="long enough that none finishes in the window")
    ap.add_argument("--batched-tokens", type=int, default=16384)
    ap.add_argument("--time-scale", type=float, default=1.0, help="simulated step time multiplier")
    ap.add_argument("--ramp-s", type=float, default=300.0)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "heartbeat_scale.json"))
    args = ap.parse_args()
    with EmbeddedRedis() as server:
        res = asyncio.run(main_async(args, server.url))
    out = {"benchmark": "heartbeat_scale", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "command": " ".join(["python"] + sys.argv),
           "workers": args.workers, "blocks_per_worker": args.blocks, "requests_per_worker": args.requests, **res}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    d, i = res["decode"], res["idle"]
    print(f"decode: heartbeat share of the step thread's CPU max {d['heartbeat_share_max']:.4%} mean "
          f"{d['heartbeat_share_mean']:.4%}, of its wall time max {d['heartbeat_share_of_wall_max']:.4%}; {d['redis_bytes_per_heartbeat']} B/heartbeat for "
          f"{d['prefix_changes_per_heartbeat']} prefix changes; idle: {i['redis_bytes_per_heartbeat']} B/heartbeat; "
          f"previous heartbeat: {res['previous_heartbeat_cpu_ms_per_beat'][0]} ms/beat "
          f"(~{res['previous_heartbeat_share_estimate'][0]:.2%}); whole set {res['whole_prefix_set_bytes']} B")


if __name__ == "__main__":
    main()
