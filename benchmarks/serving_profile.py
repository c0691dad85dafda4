"""Where the CPU goes while `folio serve` streams: per process (as a share of the machine's
cores) and, inside the worker and the frontend replica, per component (py-spy samples).

    python benchmarks/serving_profile.py --model models/tiny-llama-8l [--streams 64] [--api http]

`folio serve --num-workers 1` is driven by `folio bench` (random 50 -> 100 tokens, greedy,
--streams concurrent requests, HTTP or gRPC) for --seconds; meanwhile psutil reads every
process's CPU time (the serve tree and the load client) and `py-spy record --idle` samples
the worker and the replica. Each sample is put in the first component whose pattern
matches a frame of its stack (COMPONENTS, innermost frames first), so a share is "of
that process's samples". Results: benchmarks/results/serving_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_local import start_server, stop_server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# (component, substrings of a frame "function (file)"), tried in order on the innermost frame first
COMPONENTS = [
    ("forward: model + kernels", ["model_runner.py", "models/", "kernels/", "torch/nn/"]),
    ("sampling", ["sampler.py"]),
    ("scheduler + KV blocks", ["scheduler.py", "block_manager.py", "block_pool.py", "swap_space.py"]),
    ("engine step (outputs, other)", ["engine.py", "outputs.py", "fault_isolation.py", "sequence.py"]),
    ("detokenize + stop strings", ["detokenizer.py", "stream_text.py", "tokenizers"]),
    ("worker streaming (outbox, channel)", ["outbox.py", "actor.py", "worker_client.py", "messages.py"]),
    ("heartbeat + Redis", ["heartbeat.py", "state.py", "redis/", "prefix_walk.py"]),
    ("router", ["router.py", "policies.py", "hashing.py"]),
    ("HTTP / SSE / JSON", ["openai_http.py", "openai_logprobs.py", "serve_deployment.py", "starlette/", "uvicorn/",
                           "fastapi/", "h11/", "json/"]),
    ("gRPC server", ["grpc_server.py", "grpc/", "protobuf"]),
    ("frontend (admission, metrics)", ["frontend.py", "metrics.py", "prometheus_client"]),
    ("Ray core (serialization, calls)", ["ray/_private", "ray/_raylet", "ray/serve", "cloudpickle", "ray/"]),
    ("asyncio event loop", ["asyncio/", "uvloop"]),
    ("threads waiting / idle", ["threading.py", "queue.py", "selectors.py", "time.sleep", "wait ("]),
]


def classify(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for name, pats in COMPONENTS:
            if any(p in frame for p in pats):
                return name
    return "other"


def profile(pid: int, seconds: float, out: str) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
                             "--format", "raw", "--idle", "--nonblocking", "--threads", "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize(raw_path: str) -> dict:
    counts: collections.Counter = collections.Counter()
    total = 0
    idle = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            n = int(n)
            total += n
            comp = classify(frames)
            counts[comp] += n
            if comp == "threads waiting / idle":
                idle += n
    return {"samples": total, "busy_share": round(1 - idle / total, 3) if total else None,
            "components": {k: round(v / total, 3) for k, v in counts.most_common()}}


def find(tree: list[psutil.Process], marker: str) -> psutil.Process | None:
    for p in tree:
        try:
            if any(marker in a for a in p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    except psutil.Error:
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--api", choices=["http", "grpc"], default="http")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving_profile.json"))
    args = ap.parse_args()
    server, http, grpc_port = start_server(args.model, 1, "--num-kv-blocks", "1024", "--max-model-len", "1024",
                                           "--max-num-requests", "1024", "--namespace", f"prof{os.getpid()}")
    tmp = tempfile.mkdtemp(prefix="folio-prof-")
    try:
        target = f"grpc://127.0.0.1:{grpc_port}" if args.api == "grpc" else f"http://127.0.0.1:{http}"
        bench = [sys.executable, "-m", "folio.deploy.cli", "bench", "--target", target, "--workload", "random",
                 "--input-len", "fixed:50", "--output-len", "fixed:100", "--max-concurrency", str(args.streams),
                 "--quiet"]
        subprocess.run(bench + ["--num-requests", "8", "--out", os.path.join(tmp, "warm.json")], check=True,
                       capture_output=True)
        n = int(args.streams * max(4, args.seconds))  # enough requests to outlast the window
        client_log = open(os.path.join(tmp, "client.log"), "w")
        client = subprocess.Popen(bench + ["--num-requests", str(n), "--out", os.path.join(tmp, "load.json")],
                                  stdout=client_log, stderr=subprocess.STDOUT)
        time.sleep(3.0)  # past the ramp
        tree = [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True)
        worker, replica = find(tree, "EngineWorker"), find(tree, "FolioFrontend")
        procs = {"load client (folio bench)": psutil.Process(client.pid)}
        for p in tree:
            try:
                name = ("worker" if p == worker else "frontend replica" if p == replica else
                        "folio serve (driver)" if p.pid == server.pid else
                        "redis" if "redis" in p.name() else "ray " + p.name())
            except psutil.Error:
                continue
            procs[f"{name} [{p.pid}]" if name.startswith("ray ") else name] = p
        before = {k: cpu(p) for k, p in procs.items()}
        spies = {k: profile(p.pid, args.seconds, os.path.join(tmp, f"{k}.txt"))
                 for k, p in (("worker", worker), ("frontend replica", replica)) if p is not None}
        t0 = time.monotonic()
        for s in spies.values():
            s.wait()
        wall = time.monotonic() - t0
        after = {k: cpu(p) for k, p in procs.items()}
        if client.poll() is not None:
            raise SystemExit(f"the load client ended before the window did (exit {client.returncode}):\n"
                             + open(os.path.join(tmp, "client.log")).read()[-3000:])
        client.terminate()
        client.wait(30)
    finally:
        stop_server(server)
    ncpu = psutil.cpu_count()
    shares = {k: round((after[k] - before[k]) / wall / ncpu, 3) for k in procs}
    ray_other = round(sum(v for k, v in shares.items() if k.startswith("ray ")), 3)
    shares = {k: v for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if not k.startswith("ray ")}
    shares["other Ray processes (raylet, GCS, Serve controller, ...)"] = ray_other
    doc = {"benchmark": "serving_profile", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "cores": ncpu, "streams": args.streams, "api": args.api,
           "window_s": round(wall, 1), "cpu_share_of_machine": shares,
           "py_spy": {k: summarize(os.path.join(tmp, f"{k}.txt")) for k in spies}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
