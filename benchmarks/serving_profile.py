"""Where the CPU goes while `folio serve` streams: per process (as a share of the machine's
cores) and, inside the worker and the frontend replica, per component (py-spy samples).

    python benchmarks/serving_profile.py --model models/tiny-llama-8l [--streams 64] [--api http]

`folio serve --num-workers 1` is driven by `folio bench` (random 50 -> 100 tokens, greedy,
--streams concurrent requests, HTTP or gRPC) for --seconds; meanwhile psutil reads every
process's CPU time (the serve tree, the load client and the two py-spy samplers) and `py-spy
record` samples the Python threads of the worker and the replica that are running or
runnable (py-spy leaves out threads that wait; with `--idle` a thread parked in C, such as
Ray's main thread in its core worker loop, was counted as busy). Each sample is put in the
first component whose pattern matches a frame of its stack (COMPONENTS, innermost frames
first). A sample says where a thread was, not that it ran (under contention a runnable
thread waits for a core), so each thread's CPU is read from /proc over the window and split
over components by that thread's samples; threads with no samples (the OpenMP team, Ray's,
gRPC's C++ threads) are listed by their OS name. Results: benchmarks/results/serving_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
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
RATE = 100  # py-spy samples per second (--rate)


# a thread's own entry frames: a stack whose innermost frame is one of these is the thread in
# C below its entry point (uvloop's loop and socket I/O, grpcio's poller, Ray's core worker)
ENTRY_FRAMES = ("Thread.run (threading.py", "_run_user_code_event_loop", "Worker.main_loop (ray/", "_bootstrap")


def classify(stack: list[str]) -> str:
    if stack and any(e in stack[-1] for e in ENTRY_FRAMES):
        name = re.sub(r"[-_]?\d+", "", stack[0].split(": ", 1)[-1])  # "thread (tid): Thread-1 (...)" -> its kind
        return f"C code below the thread's entry: {name}"
    for frame in reversed(stack):  # innermost first
        for name, pats in COMPONENTS:
            if any(p in frame for p in pats):
                return name
    return "other"


def profile(pid: int, seconds: float, out: str, rate: int) -> subprocess.Popen:
    if rate <= 0:  # no sampler: a process that waits out the window
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid", str(pid),
                             "--duration", str(int(seconds)), "--rate", str(rate), "--format", "raw", "--nonblocking",
                             "--threads", "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (OS thread name, CPU seconds so far) of every thread of the process."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime, stime
    return out


def summarize(raw_path: str, before: dict, after: dict, wall: float) -> dict:
    """Where a process's CPU went, in cores: each thread's measured CPU (from /proc, over the
    window) split over components by that thread's py-spy samples; threads py-spy never saw
    running Python (the OpenMP team, Ray's and gRPC's C++ threads) by their OS name."""
    by_thread: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    names: dict[int, str] = {}
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            head = frames[0]  # "thread (tid): name"
            try:
                tid = int(head[head.index("(") + 1:head.index(")")])
            except ValueError:
                continue
            names[tid] = head.split(": ", 1)[-1]
            by_thread[tid][classify(frames)] += int(n)
    cores = {tid: (after[tid][1] - before.get(tid, (None, 0.0))[1]) / wall for tid in after}
    comps: collections.Counter = collections.Counter()
    native: collections.Counter = collections.Counter()
    python_threads: dict[str, float] = {}
    for tid, c in cores.items():
        samples = by_thread.get(tid)
        if samples:
            total = sum(samples.values())
            for comp, n in samples.items():
                comps[comp] += c * n / total
            python_threads[f"{names[tid]} [{tid}]"] = round(c, 3)
        else:
            native[after[tid][0]] += c
    return {"process_cores": round(sum(cores.values()), 3),
            "components_cores": {k: round(v, 3) for k, v in comps.most_common() if v >= 0.0005},
            "python_threads_cores": python_threads,
            "native_threads_cores (by OS name)": {k: round(v, 3) for k, v in native.most_common() if v >= 0.0005}}


def generated_tokens(port: int) -> float:
    """The cluster's output tokens so far, from `folio serve`'s /metrics (its load figures)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("folio_generation_tokens_total"))


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
    ap.add_argument("--rate", type=int, default=RATE, help="py-spy samples per second; 0: no py-spy (the CPU "
                    "shares and tok/s without the samplers' own perturbation)")
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
        tokens_before = generated_tokens(http)
        threads_before = {k: thread_cpu(p.pid) for k, p in (("worker", worker), ("frontend replica", replica)) if p}
        spies = {k: profile(p.pid, args.seconds, os.path.join(tmp, f"{k}.txt"), args.rate)
                 for k, p in (("worker", worker), ("frontend replica", replica)) if p is not None}
        spy_procs = [psutil.Process(s.pid) for s in spies.values()]
        spy_cpu = 0.0
        t0 = time.monotonic()
        while any(s.poll() is None for s in spies.values()):
            spy_cpu = sum(cpu(p) for p in spy_procs)  # a sampler's last reading before it exits
            time.sleep(0.2)
        wall = time.monotonic() - t0
        after = {k: cpu(p) for k, p in procs.items()}
        tokens_after = generated_tokens(http)
        threads_after = {k: thread_cpu(p.pid) for k, p in (("worker", worker), ("frontend replica", replica)) if p}
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
    shares["the py-spy samplers (this benchmark's own)"] = round(spy_cpu / wall / ncpu, 3)
    shares["idle or elsewhere on the machine"] = round(1 - sum(shares.values()), 3)
    doc = {"benchmark": "serving_profile", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "cores": ncpu, "streams": args.streams, "api": args.api,
           "window_s": round(wall, 1), "output_tokens_per_s": round((tokens_after - tokens_before) / wall, 1),
           "cpu_share_of_machine": shares,
           "py_spy_rate": args.rate,
           "cores_by_component": {k: summarize(os.path.join(tmp, f"{k}.txt"), threads_before[k], threads_after[k],
                                               wall) for k in spies} if args.rate > 0 else None}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
