"""Variants of `folio serve` or of its load client, alternated on ONE server: the same engine,
the same Ray, the same minutes (this 2-core machine's speed drifts 10-30 % between
processes, so a server per variant measures the drift).

    python benchmarks/served_ab.py --model models/tiny-llama-8l --variants nice=15,nice=0,engine-nice=0
    python benchmarks/served_ab.py --model models/tiny-llama-8l --variants client:FOLIO_BENCH_UVLOOP=0,default
        [--streams 16,64] [--rounds 3] [--grpc]

A variant is one of:
- nice=N: every thread of every Ray worker process (the engine worker, the frontend replica,
  the coordinator, Serve's controller; not Ray's agents) reniced to N. Ray starts its workers
  at nice 15, below its GCS and raylet, the `folio serve` driver and the load client (0);
- engine-nice=N: the engine worker's threads at N, the other workers' at 15;
- pin / unpin: the engine's step thread and the OpenMP threads it started (named folio-step)
  pinned one per CPU in the order they started (as vLLM's VLLM_CPU_OMP_THREADS_BIND pins its
  team), or given every CPU back;
- client:NAME=VALUE: the load client (`folio bench`) run with NAME=VALUE in its environment;
- bench:--FLAG=VALUE: the load client run with that flag (bench:--stream-interval=4);
- server:NAME=VALUE[;NAME=VALUE]: a second `folio serve`, started beside the first with these in
  its environment (settings read once at start, such as GOMP_SPINCOUNT) and idle while the
  other is measured; both come up in the same minutes and stay up, so drift hits both;
- default: Ray's own settings (every thread's nice as it was when the server came up, unpinned);
- several joined by '+' (nice=0+pin): applied in that order.
Every variant starts from the default, so none inherits the one before it. Each round runs the variants in order and then in reverse (A B B A). A run is `folio bench` at
`streams` concurrent streams of 50 -> 100 tokens (4 requests a stream); its CPU time (user +
system, its ~0.5 s of start-up included) and the frontend replica's over the run are recorded
per 1,000 output tokens. Results: benchmarks/results/served_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import served_procs as procs  # noqa: E402
import serving_path_cost as spc  # noqa: E402


AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # the raylet's helpers, started at nice 0


def ray_workers(root: int) -> dict[int, str]:
    """pid -> name of the Ray worker processes of `folio serve`'s tree (the raylet's children;
    not its agents, which Ray starts at nice 0)."""
    import psutil

    out = {}
    for p in psutil.Process(root).children(recursive=True):
        try:
            name = p.cmdline()[0] if p.cmdline() else p.name()
        except psutil.Error:
            continue
        if name.startswith("ray::") and not name.startswith(AGENTS):
            out[p.pid] = name
    return out


def renice(pids, nice: int) -> int:
    """Every thread of each process to `nice` (Linux: nice is per thread); how many were set."""
    n = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                n += 1
            except OSError:  # a thread that ended meanwhile
                continue
    return n


def step_threads(pid: int) -> list[int]:
    """The engine's step thread and its OpenMP team (named folio-step: actor_steps.py), by start."""
    tids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{tid}/comm").read().startswith("folio-step"):
                tids.append(int(tid))
        except OSError:
            continue
    return sorted(tids)


def pin(workers: dict[int, str], on: bool) -> list:
    engine = next(p for p, n in workers.items() if "EngineWorker" in n)
    cpus = sorted(os.sched_getaffinity(0))
    placed = []
    for i, tid in enumerate(step_threads(engine)):
        mask = {cpus[i % len(cpus)]} if on else set(cpus)
        os.sched_setaffinity(tid, mask)
        placed.append((tid, sorted(mask)))
    return placed


def thread_nices(pids) -> dict[int, int]:
    """tid -> nice of every thread of these processes, now."""
    out = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
            try:
                out[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
            except OSError:
                continue
    return out


def restore(workers: dict[int, str], nices: dict[int, int]) -> None:
    """Back to the default: each thread's nice as recorded at start, the step threads unpinned."""
    for tid, nice in nices.items():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # a thread that ended meanwhile
            continue
    pin(workers, False)


def apply(variant: str, workers: dict[int, str], nices: dict[int, int]) -> dict:
    """Set a variant up from the default; the load client's extra environment."""
    restore(workers, nices)
    env: dict = {}
    for part in variant.split("+"):
        env.update(apply_one(part, workers))
    return env


def apply_one(variant: str, workers: dict[int, str]) -> dict:
    kind, _, value = variant.partition("=")
    if variant in ("pin", "unpin"):
        print(variant, pin(workers, variant == "pin"), flush=True)
    elif kind == "engine-nice":
        renice([p for p, n in workers.items() if "EngineWorker" not in n], 15)
        renice([p for p, n in workers.items() if "EngineWorker" in n], int(value))
    elif kind == "nice":
        renice(workers, int(value))
    elif variant.startswith("client:"):
        name, _, value = variant[len("client:"):].partition("=")
        return {name: value}
    elif variant.startswith("bench:"):
        flag, _, value = variant[len("bench:"):].partition("=")
        return {ARGS: [flag, value]}
    elif variant != "default":
        raise SystemExit(f"unknown variant {variant!r}")
    return {}


def _cpu_s(pid: int | None) -> float:
    import psutil

    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


ARGS = "--args"  # (in a variant's environment: flags for the load client, not a variable)


def bench(target: str, streams: int, out: str, env: dict | None = None, replica: int | None = None) -> dict:
    env = dict(env or {})
    extra = env.pop(ARGS, [])
    cmd = [sys.executable, "-m", "folio.deploy.cli", "bench", "--target", target, "--workload", "random",
           "--input-unit", "tokens", "--token-id-range", "16-8000", "--input-len", f"fixed:{spc.PROMPT}",
           "--output-len", f"fixed:{spc.OUTPUT}", "--max-concurrency", str(streams),
           "--num-requests", str(4 * streams), "--quiet", "--out", out, *extra]
    c0, r0 = resource.getrusage(resource.RUSAGE_CHILDREN), _cpu_s(replica)
    subprocess.run(cmd, env=dict(procs.SERVE_ENV, **env), check=True, capture_output=True)
    c1, r1 = resource.getrusage(resource.RUSAGE_CHILDREN), _cpu_s(replica)
    s = json.load(open(out))["runs"][0]["summary"]
    cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    return {"output_tokens_per_s": round(s["output_throughput"], 1), "tpot_ms_median": round(1e3 * s["tpot_s"]["median"], 1),
            "ttft_ms_median": round(1e3 * s["ttft_s"]["median"], 1),
            "client_cpu_s_per_1k_tokens": round(1e3 * cpu / s["output_tokens"], 3),  # its start-up included
            "client_run_cpu_s_per_1k_tokens": round(s["client_cpu_s_per_1k_output_tokens"], 3),  # over its run only
            "replica_cpu_s_per_1k_tokens": round(1e3 * (r1 - r0) / s["output_tokens"], 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--variants", required=True, help="comma-separated (see above)")
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--grpc", action="store_true", help="drive the gRPC API (default: HTTP)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "served_ab.json"))
    args = ap.parse_args()
    variants, streams = args.variants.split(","), [int(s) for s in args.streams.split(",")]
    # one server for every variant but the server: ones, each of which has its own
    envs = {"": {}} | {v: dict(kv.split("=", 1) for kv in v[len("server:"):].split(";"))
                       for v in variants if v.startswith("server:")}
    servers = {key: procs.start_folio(args.model, spc.KV_BLOCKS, env=env) for key, env in envs.items()}
    out = os.path.join(tempfile.mkdtemp(), "bench.json")
    runs = []
    try:
        state = {}
        for key, (srv, port, grpc_port) in servers.items():
            procs.wait_ready(srv, port)
            workers = ray_workers(srv.pid)
            target = f"grpc://127.0.0.1:{grpc_port}" if args.grpc else f"http://127.0.0.1:{port}"
            state[key] = (target, workers, thread_nices(workers))
            print(key or "default server", "Ray workers:", workers, "nice now:",
                  {p: procs.thread_nice(p) for p in workers}, flush=True)
            for n in streams:
                bench(target, n, out)  # warm-up
        for r in range(args.rounds):
            for v in variants + variants[::-1]:
                target, workers, nices = state[v if v in state else ""]
                env = {} if v.startswith("server:") else apply(v, workers, nices)
                for n in streams:
                    replica = next((p for p, m in workers.items() if "ServeReplica" in m), None)
                    res = {"round": r, "variant": v, "streams": n, **bench(target, n, out, env, replica),
                           "engine_thread_nice": procs.thread_nice(next(p for p, m in workers.items() if "EngineWorker" in m))}
                    runs.append(res)
                    print(json.dumps(res), flush=True)
    finally:
        for srv, _, _ in servers.values():
            procs.stop_tree(srv)
    summary = {}
    for n in streams:
        base = statistics.mean(r["output_tokens_per_s"] for r in runs if r["streams"] == n and r["variant"] == variants[0])
        for v in variants:
            got = [r["output_tokens_per_s"] for r in runs if r["streams"] == n and r["variant"] == v]
            cpu = [r["client_cpu_s_per_1k_tokens"] for r in runs if r["streams"] == n and r["variant"] == v]
            rcpu = [r["replica_cpu_s_per_1k_tokens"] for r in runs if r["streams"] == n and r["variant"] == v]
            run_cpu = [r["client_run_cpu_s_per_1k_tokens"] for r in runs if r["streams"] == n and r["variant"] == v]
            summary[f"{v} @ {n} streams"] = {"output_tokens_per_s_mean": round(statistics.mean(got), 1),
                                             f"over {variants[0]}": round(statistics.mean(got) / base, 3), "runs": got,
                                             "client_cpu_s_per_1k_tokens_mean": round(statistics.mean(cpu), 3),
                                             "client_run_cpu_s_per_1k_tokens_mean": round(statistics.mean(run_cpu), 3),
                                             "replica_cpu_s_per_1k_tokens_mean": round(statistics.mean(rcpu), 4)}
    doc = {"benchmark": "served_ab", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python"] + sys.argv),
           "target": "grpc" if args.grpc else "http", "order": "per round: variants, then reversed (A B B A), one server",
           "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
