"""What the transport of a worker's output stream costs the forward: one request at a time
(a 16-token prompt, --tokens output tokens, greedy), read three ways from the same
`EngineWorker`:

- inprocess: the worker in this process, its stream read here (no transport);
- ray-stream: the worker as a Ray actor, its `subscribe` stream read as a Ray streaming
  generator (what RayWorkerClient did until 2026-12-02), submits through `commands`;
- ray-tcp: the worker as a Ray actor read through RayWorkerClient: submits through
  `commands`, chunks over the worker's TCP data plane (worker/data_plane.py).

Reports the engine's forward milliseconds per step (its own timer), the machine's context
switches per step (/proc/stat, every process), and the request's latency (median). With
--abba the modes run in order and then in reverse, each in a fresh process; figures are
the mean of the two runs.

    python benchmarks/data_plane.py --model models/tiny-llama-8l [--tokens 16] [--abba]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["inprocess", "ray-stream", "ray-tcp"]
REQUESTS, WARMUP = 60, 10


def context_switches() -> int:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("ctxt"):
                return int(line.split()[1])
    return 0


def requests(n: int, tokens: int):
    from folio.worker.messages import GenerateRequest
    from folio.worker.sampling_params import SamplingParams

    rng = random.Random(1)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(request_id=f"dp{i}-{time.time_ns()}",
                            prompt_token_ids=[rng.randrange(16, 8000) for _ in range(16)], params=params)
            for i in range(n)]


async def measure(generate, timings, tokens: int) -> dict:
    lat = []
    before, cs0 = await timings(), context_switches()
    for r in requests(REQUESTS, tokens):
        t0 = time.perf_counter()
        async for _ in generate(r):
            pass
        lat.append(1e3 * (time.perf_counter() - t0))
    after, cs1 = await timings(), context_switches()
    steps = after["steps"] - before["steps"]
    return {"forward_ms_per_step": round(1e3 * (after["forward"] - before["forward"]) / steps, 3),
            "context_switches_per_step": round((cs1 - cs0) / steps, 1),
            "latency_ms_median": round(statistics.median(lat[WARMUP:]), 2), "steps": steps}


def engine_config(model: str):
    from folio.worker import EngineConfig

    return EngineConfig(model=os.path.abspath(model), block_size=16, num_kv_blocks=1024, max_model_len=1024)


def run_inprocess(model: str, tokens: int) -> dict:
    from folio.cluster.launcher import make_engine
    from folio.worker.actor import EngineWorker

    w = EngineWorker("w0", functools.partial(make_engine, engine_config(model), os.cpu_count()), None)
    try:
        return asyncio.run(measure(w.generate, lambda: w._call(lambda e: dict(vars(e.timings))), tokens))
    finally:
        w.shutdown()


def _ray_stream_generate(handle, subscriber: str):
    """The old client, reduced to one request at a time: submit over `commands`, read the
    request's chunks from the worker's `subscribe` Ray stream."""
    state = {"gen": None}

    async def generate(req):
        if state["gen"] is None:
            state["gen"] = handle.subscribe.options(num_returns="streaming",
                                                    _generator_backpressure_num_objects=2).remote(subscriber)
        await handle.commands.remote(subscriber, [("submit", req)])
        while True:
            batch = await (await state["gen"].__anext__())
            for rid, item in batch:
                yield item
                if rid == req.request_id and item.finished:
                    return
    return generate


def run_ray(model: str, tokens: int, transport: str) -> dict:
    import ray

    from folio.cluster.launcher import make_engine
    from folio.cluster.worker_client import RayWorkerClient, actor_name
    from folio.worker.actor import EngineWorker

    ray.init(num_gpus=1, num_cpus=os.cpu_count(), _temp_dir=tempfile.mkdtemp(prefix="folio-dp-"), namespace="dp",
             log_to_driver=False, include_dashboard=False)
    try:
        h = ray.remote(EngineWorker).options(name=actor_name("dp", "w0"), namespace="dp", num_gpus=1, num_cpus=0.5,
                                             max_concurrency=1000).remote(
            "w0", functools.partial(make_engine, engine_config(model), os.cpu_count()), None, 0.1)
        ray.get(h.ping.remote())
        if transport == "tcp":
            client = RayWorkerClient("dp", "dp")
            gen = functools.partial(client.generate, "w0")
        else:
            gen = _ray_stream_generate(h, "fe-bench")

        async def timings():
            return await h._call.remote(lambda e: dict(vars(e.timings)))

        return asyncio.run(measure(gen, timings, tokens))
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--abba", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a mode in this process (the driver runs each fresh)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "data_plane.json"))
    args = ap.parse_args()
    if args.one:
        res = (run_inprocess(args.model, args.tokens) if args.one == "inprocess" else
               run_ray(args.model, args.tokens, args.one.split("-")[1]))
        print("RESULT " + json.dumps(res), flush=True)
        return
    modes = args.modes.split(",")
    order = modes + modes[::-1] if args.abba else modes
    runs = []
    for m in order:
        p = subprocess.run([sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens), "--one", m],
                           capture_output=True, text=True, check=True)
        res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
        print(m, res, flush=True)
        runs.append({"mode": m, "result": res})
    mean = {m: {k: round(statistics.mean(r["result"][k] for r in runs if r["mode"] == m), 3)
                for k in ("forward_ms_per_step", "context_switches_per_step", "latency_ms_median")} for m in modes}
    print(json.dumps(mean, indent=1))
    out = {"benchmark": "data_plane", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
           "cpu": _cpu(), "load": {"prompt_tokens": 16, "output_tokens": args.tokens, "requests": REQUESTS,
                                   "one_at_a_time": True}, "runs": runs, "mean": mean}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "?"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
