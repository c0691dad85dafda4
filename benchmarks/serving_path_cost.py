"""Where serving loses throughput on this machine: the same worker and the same load
(16 and 64 concurrent streams, each running --rounds requests of 50-token prompts ->
100 tokens, greedy, one after another), driven four ways:

- inprocess: `EngineWorker` in this process, its streams read directly;
- ray: `EngineWorker` as a Ray actor (as `folio serve` runs it), streams read through
  `RayWorkerClient` (one channel to the worker: submits and aborts in ordered batches,
  one frame per step for all of the client's requests, over TCP since 2026-12-02 and
  through a Ray stream and Ray calls before);
- serve-grpc: `folio serve --num-workers 1`, streams read over gRPC by `folio bench`
  (adds the Serve replica, where the gRPC server runs: one more process per token);
- serve: the same over HTTP (the replica serves HTTP itself: deploy/http_server.py);
- vllm-offline / vllm-serve (with --modes): vLLM's offline `LLM` on the same token ids,
  `streams` at a time, and `vllm serve` driven by the same `folio bench` command: vLLM's
  served / offline ratio is the reference of what this machine allows a served engine.

    python benchmarks/serving_path_cost.py --model models/tiny-llama-8l [--streams 16,64] [--abba]
        [--modes inprocess,ray,serve-grpc,serve,vllm-offline,vllm-serve]

Every mode sends the same prompts: PROMPT random token ids (`folio bench --input-unit tokens`;
until 2026-12-01 the served modes sent 50 *words*, 190 tokens of this tokenizer, which
overflowed the KV cache at 64 streams and made them preempt: those figures were not
comparable). The load client (`folio bench`, another process) shares the machine's cores with the
server, as it does in any one-machine comparison. With --abba the modes run in order and
then in reverse, and each figure is the mean of its two runs (this machine is noisy).

Reports output tokens/s and the engine's steps and forward time per step (its own timers;
for the served modes read from /metrics: folio_engine_steps_total and
folio_engine_step_seconds_total{phase="forward"}), and for the served modes the CPU seconds
per 1,000 output tokens of each process role (engine, frontend / API server, the load
client over its run and with its start-up, the rest) and how often the engine's threads were taken off a core (involuntary
context switches of its process's threads, per second and per step), to
`benchmarks/results/serving_path_cost.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from served_procs import (SERVE_ENV, cpu_by_role, engine_counters, engine_pid, engine_preemptions,  # noqa: E402
                          free_port, start_folio, stop_tree, thread_nice, thread_preemptions, wait_ready)

PROMPT, OUTPUT = 50, 100
STREAMS = [16, 64]
ROUNDS = 2
KV_BLOCKS = 1024  # 64 streams x 10 blocks fit: no preemption in any mode


def requests(n):
    from folio.worker import SamplingParams
    from folio.worker.messages import GenerateRequest

    rng = random.Random(0)
    return [GenerateRequest(request_id=f"r{i}", prompt_token_ids=[rng.randrange(16, 8000) for _ in range(PROMPT)],
                            params=SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True))
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


def run_inprocess(model, threads=None) -> dict:
    import torch

    from folio.worker import LLMEngine
    from folio.worker.actor import EngineWorker

    if threads:
        torch.set_num_threads(threads)
    w = EngineWorker("w0", functools.partial(LLMEngine, engine_config(model)), None)

    async def timings():
        return await w._call(lambda e: dict(vars(e.timings)))

    def one(n):
        pre0, t0 = thread_preemptions(os.getpid()), time.perf_counter()
        res = asyncio.run(drive(w.generate, timings, n))
        pre, wall = thread_preemptions(os.getpid()) - pre0, time.perf_counter() - t0
        return dict(res, engine_involuntary_switches_per_s=round(pre / wall),
                    engine_involuntary_switches_per_step=round(pre / res["steps"], 1))
    try:
        return {n: one(n) for n in STREAMS}
    finally:
        w.shutdown()


def run_ray(model, threads=None) -> dict:
    import ray

    from folio.cluster.launcher import make_engine
    from folio.cluster.worker_client import RayWorkerClient, actor_name
    from folio.worker.actor import EngineWorker

    ray.init(num_gpus=1, num_cpus=os.cpu_count(), _temp_dir=tempfile.mkdtemp(prefix="folio-cost-"),
             namespace="cost", log_to_driver=False, include_dashboard=False)
    try:
        h = ray.remote(EngineWorker).options(name=actor_name("cost", "w0"), namespace="cost", num_gpus=1,
                                             num_cpus=0.5, max_concurrency=1000).remote(
            "w0", functools.partial(make_engine, engine_config(model), threads or os.cpu_count()), None, 0.1)
        ray.get(h.ping.remote())
        client = RayWorkerClient("cost", "cost")

        async def timings():
            return await h._call.remote(lambda e: dict(vars(e.timings)))

        async def all_loads():
            return {n: await drive(lambda req: client.generate("w0", req), timings, n) for n in STREAMS}
        return asyncio.run(all_loads())
    finally:
        ray.shutdown()


def run_serve(model, threads=None, grpc: bool = False) -> dict:
    srv, port, grpc_port = start_folio(model, KV_BLOCKS, threads)
    target = f"grpc://127.0.0.1:{grpc_port}" if grpc else f"http://127.0.0.1:{port}"
    return _drive_server(srv, port, target)


def _drive_server(srv: subprocess.Popen, port: int, target: str, ready_s: float = 300) -> dict:
    env = SERVE_ENV
    # mode+FOLIO_COST_STREAM_INTERVAL=N: the load client asks for N tokens a streamed chunk
    # (stream_interval, Folio's and vLLM's); the server's own default stays 1
    interval = os.environ.get("FOLIO_COST_STREAM_INTERVAL")
    try:
        wait_ready(srv, port, ready_s)
        out = os.path.join(tempfile.mkdtemp(), "bench.json")
        res = {}
        for n in STREAMS:
            bench = [sys.executable, "-m", "folio.deploy.cli", "bench", "--target", target,
                     "--workload", "random", "--input-unit", "tokens", "--token-id-range", "16-8000",
                     "--input-len", f"fixed:{PROMPT}", "--output-len", f"fixed:{OUTPUT}",
                     "--max-concurrency", str(n), "--quiet", "--out", out,
                     *(["--stream-interval", interval] if interval else [])]
            subprocess.run(bench + ["--num-requests", "4"], env=env, check=True, capture_output=True)  # warm-up
            time.sleep(0.5)  # the workers' counters reach /metrics with their heartbeat (100 ms)
            before, cpu0 = engine_counters(port), cpu_by_role(srv.pid)  # (vLLM: no such counters)
            pre0 = engine_preemptions(srv.pid)
            client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(bench + ["--num-requests", str(n * ROUNDS)], env=env, check=True, capture_output=True)
            client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu1 = cpu_by_role(srv.pid)
            preempted = engine_preemptions(srv.pid) - pre0
            nice = thread_nice(engine_pid(srv.pid))
            time.sleep(0.5)
            after = engine_counters(port)
            s = json.load(open(out))["runs"][0]["summary"]
            steps = after["steps"] - before["steps"]  # 0 for vLLM: no such counters
            cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
            # the load client over its run (folio bench's own figure), and its whole process with
            # its ~0.5 s of start-up (imports), which the run's tok/s never competed with
            cpu["load client"] = s["client_cpu_s"]
            cpu["load client, start-up included"] = ((client1.ru_utime + client1.ru_stime)
                                                     - (client0.ru_utime + client0.ru_stime))
            res[n] = {"output_tokens_per_s": round(s["output_throughput"], 1),
                      "tpot_ms_median": round(1e3 * s["tpot_s"]["median"], 1), "steps": steps,
                      "ms_per_step": round(1e3 * s["duration_s"] / steps, 1) if steps else None,
                      "forward_ms_per_step": (round(1e3 * (after["forward"] - before["forward"]) / steps, 1)
                                              if steps else None),
                      # CPU seconds per 1,000 output tokens, per process role: the frontend's
                      # cost per token, less at the mercy of this machine's noise than tok/s
                      "cpu_s_per_1k_tokens": {k: round(1e3 * v / s["output_tokens"], 3) for k, v in cpu.items()},
                      "cpu_share_of_machine": {k: round(v / s["duration_s"] / os.cpu_count(), 3)
                                               for k, v in cpu.items()},
                      # the engine's threads taken off a core by other processes' threads
                      "engine_involuntary_switches_per_s": round(preempted / s["duration_s"]),
                      "engine_involuntary_switches_per_step": round(preempted / steps, 1) if steps else None,
                      "engine_thread_nice": nice}
        return res
    finally:
        stop_tree(srv)


ROOT = os.path.dirname(HERE)
VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")  # benchmarks/vs_peers_offline.py --setup-vllm
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}


def vllm_prompts(n: int) -> list[list[int]]:
    """The token ids `requests` makes, without importing Folio (this runs in vLLM's venv)."""
    rng = random.Random(0)
    return [[rng.randrange(16, 8000) for _ in range(PROMPT)] for _ in range(n)]


def vllm_args(model: str) -> dict:
    # the same KV budget in tokens; vLLM's CPU attention takes block sizes that are multiples of 32
    return dict(model=os.path.abspath(model), dtype="float32", max_model_len=1024, block_size=32,
                num_gpu_blocks_override=KV_BLOCKS * 16 // 32, seed=0)


def run_vllm_offline(model, threads=None) -> dict:
    """vLLM's offline LLM on the same requests, `streams` at a time (max_num_seqs), as the
    in-process mode runs them: the reference the served vLLM is measured against."""
    from vllm import LLM, SamplingParams

    res = {}
    for n in STREAMS:
        llm = LLM(max_num_seqs=n, **vllm_args(model))
        params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in vllm_prompts(1 + n * ROUNDS)]
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        res[n] = {"output_tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / wall, 1)}
        del llm
    return res


def run_vllm_serve(model, threads=None) -> dict:
    """`vllm serve` (its OpenAI server: API process + engine-core process), driven by the same
    `folio bench` command as Folio's HTTP mode."""
    port = free_port()
    a = vllm_args(model)
    cmd = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", a["model"], "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--block-size", "32", "--num-gpu-blocks-override",
           str(a["num_gpu_blocks_override"]), "--max-model-len", "1024", "--seed", "0", "--max-num-seqs", "256"]
    tmp = tempfile.mkdtemp(prefix="folio-cost-vllm-")  # not the checkout: its kernels/ shadows vLLM's import
    log = open(os.path.join(tmp, "vllm.log"), "w")
    srv = subprocess.Popen(cmd, env=dict(os.environ, **VLLM_ENV), stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True, cwd=tmp)
    return _drive_server(srv, port, f"http://127.0.0.1:{port}", ready_s=600)


def mode_env(mode: str) -> dict:
    """A mode's environment variants: +NAME=VALUE sets NAME (e.g. serve+RAY_worker_niceness=0).
    (+bind, FOLIO_BIND_THREADS=1, pinned the engine's OpenMP team until it was dropped for
    showing no served gain: commit 5976614 has it.)"""
    env = {}
    for part in mode.split("+")[1:]:
        name, eq, value = part.partition("=")
        if not eq:
            raise SystemExit(f"a mode's variant is +NAME=VALUE, got +{part}")
        env[name] = value
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="inprocess,ray,serve-grpc,serve",
                    help="also vllm-offline,vllm-serve: vLLM's served / offline ratio at the same load; "
                         "MODE@N runs Folio's engine on N torch threads (default: every core), "
                         "MODE+NAME=VALUE with NAME set in its environment")
    ap.add_argument("--streams", default="16,64", help="concurrent streams, comma-separated")
    ap.add_argument("--abba", action="store_true", help="run the modes in order, then in reverse; average")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving_path_cost.json"))
    args = ap.parse_args()
    STREAMS[:] = [int(x) for x in args.streams.split(",")]
    if args.role:  # one mode, in a fresh process
        # mode@N: N torch threads for Folio's engine; mode+NAME=VALUE: an environment variant
        name, _, threads = args.role.split("+")[0].partition("@")
        fn = {"inprocess": run_inprocess, "ray": run_ray, "serve": run_serve,
              "serve-grpc": functools.partial(run_serve, grpc=True), "vllm-offline": run_vllm_offline,
              "vllm-serve": run_vllm_serve}[name]
        print("RESULT " + json.dumps(fn(args.model, int(threads) if threads else None)))
        return 0
    doc = {"benchmark": "serving_path_cost", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv),
           "load": {"streams": STREAMS, "requests_per_stream": ROUNDS, "prompt_tokens": PROMPT,
                    "output_tokens": OUTPUT, "kv_blocks": KV_BLOCKS}, "runs": [], "modes": {}}
    modes = args.modes.split(",")
    order = modes + modes[::-1] if args.abba else modes
    if any(m.startswith("vllm") for m in modes) and not os.path.exists(VLLM_PY):
        raise SystemExit("no vLLM venv: run benchmarks/vs_peers_offline.py --setup-vllm first")
    for mode in order:
        vllm = mode.startswith("vllm-offline")  # in vLLM's venv, outside the checkout (its kernels/ shadows vLLM's)
        p = subprocess.run([VLLM_PY if vllm else sys.executable, os.path.abspath(__file__),
                            "--model", os.path.abspath(args.model), "--role", mode, "--streams", args.streams],
                           capture_output=True, text=True, cwd=tempfile.gettempdir() if vllm else None,
                           env=dict(os.environ, RAY_AUTH_MODE="disabled", **(VLLM_ENV if vllm else {}),
                                    **mode_env(mode)))
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"{mode} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        doc["runs"].append({"mode": mode, "result": json.loads(line[7:])})
        print(mode, doc["runs"][-1]["result"], flush=True)
    for mode in modes:  # the mean of a mode's runs, per stream count
        runs = [r["result"] for r in doc["runs"] if r["mode"] == mode]
        doc["modes"][mode] = {n: {"output_tokens_per_s": round(sum(r[n]["output_tokens_per_s"] for r in runs)
                                                                  / len(runs), 1)} for n in runs[0]}
    # the in-process engine: `inprocess`, or the first `inprocess@N` (a run on N threads only)
    base = doc["modes"].get("inprocess") or next((v for m, v in doc["modes"].items() if m.startswith("inprocess@")),
                                                  None)
    if base:
        doc["share_of_inprocess"] = {m: {n: round(v[n]["output_tokens_per_s"] / base[n]["output_tokens_per_s"], 3)
                                         for n in v} for m, v in doc["modes"].items() if not m.startswith("vllm")}
        print("share of in-process:", doc["share_of_inprocess"])
    ref = doc["modes"].get("vllm-offline")
    if ref and "vllm-serve" in doc["modes"]:  # what this machine allows a served engine (issue #15)
        doc["vllm_served_over_offline"] = {n: round(doc["modes"]["vllm-serve"][n]["output_tokens_per_s"]
                                                    / ref[n]["output_tokens_per_s"], 3) for n in ref}
        print("vLLM served / offline:", doc["vllm_served_over_offline"])
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
