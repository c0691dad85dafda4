"""Where serving loses throughput on this machine: the same worker and the same load
(16 and 64 concurrent streams, each running --rounds requests of 50-token prompts ->
100 tokens, greedy, one after another), driven four ways:

- inprocess: `EngineWorker` in this process, its streams read directly;
- ray: `EngineWorker` as a Ray actor (as `folio serve` runs it), streams read through
  `RayWorkerClient` (one channel to the worker: submits and aborts in ordered batches,
  one Ray message per step for all of the client's requests);
- serve-grpc: `folio serve --num-workers 1`, streams read over gRPC by `folio bench`
  (adds the Serve replica, where the gRPC server runs: one more process per token);
- serve: the same over HTTP (the replica serves HTTP itself: deploy/http_server.py).

    python benchmarks/serving_path_cost.py --model models/tiny-llama-8l [--streams 16,64] [--abba]

The load client (`folio bench`, another process) shares the machine's cores with the
server, as it does in any one-machine comparison. With --abba the modes run in order and
then in reverse, and each figure is the mean of its two runs (this machine is noisy).

Reports output tokens/s, and for the first two the engine's forward time per step
(from the engine's own timers), to `benchmarks/results/serving_path_cost.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT, OUTPUT = 50, 100
STREAMS = [16, 64]
ROUNDS = 2
KV_BLOCKS = 1024  # 64 streams x 10 blocks fit: no preemption in any mode


def requests(n):
    from folio.worker import SamplingParams
    from folio.worker.messages import GenerateRequest

    rng = random.Random(0)
    return [GenerateRequest(f"r{i}", [rng.randrange(16, 8000) for _ in range(PROMPT)],
                            SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True))
            for i in range(n)]


async def drive(generate, timings, streams) -> dict:
    reqs = requests(1 + streams * ROUNDS)

    async def one(req):
        n = 0
        async for c in generate(req):
            n += sum(len(d.token_ids) for d in c.deltas)
        return n

    async def stream(k):
        return sum([await one(r) for r in reqs[1 + k * ROUNDS: 1 + (k + 1) * ROUNDS]])

    await one(reqs[0])  # warm-up
    before = await timings()
    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(stream(k) for k in range(streams))))
    wall = time.perf_counter() - t0
    after = await timings()
    steps = after["steps"] - before["steps"]
    return {"output_tokens_per_s": round(n / wall, 1), "steps": steps,
            "ms_per_step": round(1e3 * wall / steps, 1),
            "forward_ms_per_step": round(1e3 * (after["forward"] - before["forward"]) / steps, 1)}


def engine_config(model):
    from folio.worker import EngineConfig

    return EngineConfig(model=os.path.abspath(model), block_size=16, num_kv_blocks=KV_BLOCKS, max_model_len=1024)


def run_inprocess(model) -> dict:
    from folio.worker import LLMEngine
    from folio.worker.actor import EngineWorker

    w = EngineWorker("w0", functools.partial(LLMEngine, engine_config(model)), None)

    async def timings():
        return await w._call(lambda e: dict(vars(e.timings)))

    try:
        return {n: asyncio.run(drive(w.generate, timings, n)) for n in STREAMS}
    finally:
        w.shutdown()


def run_ray(model) -> dict:
    import ray

    from folio.cluster.app import make_engine
    from folio.cluster.worker_client import RayWorkerClient, actor_name
    from folio.worker.actor import EngineWorker

    ray.init(num_gpus=1, num_cpus=os.cpu_count(), _temp_dir=tempfile.mkdtemp(prefix="folio-cost-"),
             namespace="cost", log_to_driver=False, include_dashboard=False)
    try:
        h = ray.remote(EngineWorker).options(name=actor_name("cost", "w0"), namespace="cost", num_gpus=1,
                                             num_cpus=0.5, max_concurrency=1000).remote(
            "w0", functools.partial(make_engine, engine_config(model), os.cpu_count()), None, 0.1)
        ray.get(h.ping.remote())
        client = RayWorkerClient("cost", "cost")

        async def timings():
            return await h._call.remote(lambda e: dict(vars(e.timings)))

        async def all_loads():
            return {n: await drive(lambda req: client.generate("w0", req), timings, n) for n in STREAMS}
        return asyncio.run(all_loads())
    finally:
        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(model, grpc: bool = False) -> dict:
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    srv = subprocess.Popen([sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model, "--num-workers", "1",
                            "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(grpc_port), "--block-size", "16",
                            "--num-kv-blocks", str(KV_BLOCKS), "--max-model-len", "1024", "--max-num-requests", "1024",
                            "--namespace", f"cost{os.getpid()}", "--grace-period-s", "1"],
                           env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        out = os.path.join(tempfile.mkdtemp(), "bench.json")
        target = f"grpc://127.0.0.1:{grpc_port}" if grpc else f"http://127.0.0.1:{port}"
        res = {}
        for n in STREAMS:
            bench = [sys.executable, "-m", "folio.deploy.cli", "bench", "--target", target,
                     "--workload", "random", "--input-len", f"fixed:{PROMPT}", "--output-len", f"fixed:{OUTPUT}",
                     "--max-concurrency", str(n), "--quiet", "--out", out]
            subprocess.run(bench + ["--num-requests", "4"], env=env, check=True, capture_output=True)  # warm-up
            subprocess.run(bench + ["--num-requests", str(n * ROUNDS)], env=env, check=True, capture_output=True)
            s = json.load(open(out))["runs"][0]["summary"]
            res[n] = {"output_tokens_per_s": round(s["output_throughput"], 1),
                      "tpot_ms_median": round(1e3 * s["tpot_s"]["median"], 1)}
        return res
    finally:
        os.killpg(srv.pid, 15)
        srv.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="inprocess,ray,serve-grpc,serve")
    ap.add_argument("--streams", default="16,64", help="concurrent streams, comma-separated")
    ap.add_argument("--abba", action="store_true", help="run the modes in order, then in reverse; average")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving_path_cost.json"))
    args = ap.parse_args()
    STREAMS[:] = [int(x) for x in args.streams.split(",")]
    if args.role:  # one mode, in a fresh process
        fn = {"inprocess": run_inprocess, "ray": run_ray, "serve": run_serve,
              "serve-grpc": functools.partial(run_serve, grpc=True)}[args.role]
        print("RESULT " + json.dumps(fn(args.model)))
        return 0
    doc = {"benchmark": "serving_path_cost", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv),
           "load": {"streams": STREAMS, "requests_per_stream": ROUNDS, "prompt_tokens": PROMPT,
                    "output_tokens": OUTPUT, "kv_blocks": KV_BLOCKS}, "runs": [], "modes": {}}
    modes = args.modes.split(",")
    order = modes + modes[::-1] if args.abba else modes
    for mode in order:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", args.model, "--role", mode,
                            "--streams", args.streams],
                           capture_output=True, text=True, env=dict(os.environ, RAY_AUTH_MODE="disabled"))
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"{mode} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        doc["runs"].append({"mode": mode, "result": json.loads(line[7:])})
        print(mode, doc["runs"][-1]["result"], flush=True)
    for mode in modes:  # the mean of a mode's runs, per stream count
        runs = [r["result"] for r in doc["runs"] if r["mode"] == mode]
        doc["modes"][mode] = {n: {"output_tokens_per_s": round(sum(r[n]["output_tokens_per_s"] for r in runs)
                                                                  / len(runs), 1)} for n in runs[0]}
    base = doc["modes"].get("inprocess")
    if base:
        doc["share_of_inprocess"] = {m: {n: round(v[n]["output_tokens_per_s"] / base[n]["output_tokens_per_s"], 3)
                                         for n in v} for m, v in doc["modes"].items()}
        print("share of in-process:", doc["share_of_inprocess"])
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
