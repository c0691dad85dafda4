"""Recovery latency: SIGKILL a worker process under load, time until it serves again.

    python benchmarks/worker_restart.py --model models/tiny-llama-8l [--rounds 3]

A local cluster (2 Ray workers, embedded Redis, router) runs a stream of requests; each
round SIGKILLs w1's process (its PID from the actor) while a request streams there and
measures, from the kill:
  - failed_s: until the request streaming on w1 fails with its clear error;
  - registered_s: until w1 (restarted by Ray: a new process, a new engine) heartbeats again;
  - serving_s: until a request pinned to w1 has completed (greedy, checked against the
    offline engine).
It is a latency of recovery, not a speed: fine on a busy machine (say so with the result).
Results: benchmarks/results/worker_restart.json.

failed_s depends on Ray's RAY_timeout_ms_task_wait_for_death_info, which folio.cluster.launcher sets
to 0 unless it is set already (see there). Ray's default (1000) held the in-flight request for
1.0-2.0 s; reproduce that with RAY_timeout_ms_task_wait_for_death_info=1000 python benchmarks/...
--out benchmarks/results/worker_restart_ray_default.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time

import redis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from folio.cluster.launcher import ClusterConfig, FolioCluster  # noqa: E402
from folio.worker import LLM, SamplingParams  # noqa: E402
from folio.worker.errors import UnavailableError  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402

ENGINE = dict(block_size=16, num_kv_blocks=64, max_model_len=512)


async def one_round(cluster, r: int, probe, expected) -> dict:
    import ray

    router, w1 = cluster.router, cluster.workers["w1"]
    pid = ray.get(w1.pid.remote())
    long = GenerateRequest(request_id=f"long{r}", prompt_token_ids=list(range(20, 60)),
                           params=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    streaming = asyncio.Event()
    out: dict = {}

    async def victim():
        try:
            async for chunk in router.generate(long, worker_id="w1"):
                if chunk.deltas and chunk.deltas[0].num_tokens >= 5:
                    streaming.set()
        except UnavailableError as e:
            out["failed_s"] = time.monotonic() - t_kill
            out["error"] = str(e)
    t_kill = 0.0
    task = asyncio.create_task(victim())
    background = [asyncio.create_task(_drain(router, GenerateRequest(request_id=f"bg{r}-{i}",
                                                                     prompt_token_ids=list(range(30 + i, 50 + i)),
                                                                     params=SamplingParams(max_tokens=64))))
                  for i in range(4)]
    await asyncio.wait_for(streaming.wait(), 120)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    await asyncio.wait_for(task, 120)
    while True:
        try:
            load = router.state.live_loads().get("w1")
        except redis.RedisError:  # a read timed out (0.5 s) on the busy machine: poll again
            load = None
        if load is not None and load.timestamp > time.time() - (time.monotonic() - t_kill):
            break
        await asyncio.sleep(0.02)
    out["registered_s"] = time.monotonic() - t_kill
    tokens = []
    async for chunk in router.generate(GenerateRequest(request_id=f"pinned{r}", prompt_token_ids=probe[0],
                                                       params=probe[1]), worker_id="w1"):
        tokens += chunk.deltas[0].token_ids
    out["serving_s"] = time.monotonic() - t_kill
    out["pinned_matches_offline"] = tokens == expected
    out["new_pid"] = ray.get(w1.pid.remote()) != pid
    await asyncio.gather(*background, return_exceptions=True)
    return out


async def _drain(router, req):
    async for _ in router.generate(req):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "worker_restart.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    probe = (list(range(70, 90)), SamplingParams(max_tokens=16, temperature=0.0))
    expected = LLM(args.model, **ENGINE).generate([probe[0]], probe[1])[0].token_ids
    cluster = FolioCluster(ClusterConfig(model=args.model, num_workers=2, engine_args=ENGINE, namespace="restart",
                                         coordinator=False)).start()
    try:
        rounds = [asyncio.run(one_round(cluster, r, probe, expected)) for r in range(args.rounds)]
    finally:
        cluster.shutdown(grace_s=2)
    res = {"model": args.model, "rounds": rounds,
           "serving_s_max": max(x["serving_s"] for x in rounds),
           "failed_s_max": max(x.get("failed_s", float("nan")) for x in rounds),
           "RAY_timeout_ms_task_wait_for_death_info": os.environ.get("RAY_timeout_ms_task_wait_for_death_info"),
           "machine": f"{platform.machine()} {os.cpu_count()} cores, shared with other jobs while measured",
           "load_avg_1m_start_end": [round(load_before, 1), round(os.getloadavg()[0], 1)],
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(res, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
