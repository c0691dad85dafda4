"""CPU per request in each process of `folio serve`, one one-token request at a time.

    python benchmarks/request_cpu.py --model models/tiny-llama-8l [--api grpc] [--router prefix-aware]
        [--requests 600] [--label A] [--out benchmarks/results/request_cpu.json]

`folio serve --num-workers 1` (its default router unless --router), 50 warm-ups, then
--requests sequential requests (16-token prompt, 1 token, greedy) over gRPC `Generate` or
HTTP completions (a minimal keep-alive client, frontend_overhead.RawHttp). Reports the p50
latency and the CPU time per request of the frontend replica, the engine worker, Redis and
the rest of the server's tree, read from /proc before and after. Each run is appended to
--out under its --label, so code states can be alternated (A B B A) by running it from each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "deploy", "proto"))
from frontend_overhead import RawHttp  # noqa: E402
from request_timeline import PROMPT, client_call, roles  # noqa: E402
from serve_local import start_server, stop_server  # noqa: E402


def cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--api", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--router", default=None)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "request_cpu.json"))
    args = ap.parse_args()
    extra = ["--served-model-name", "m"] + (["--router", args.router] if args.router else [])
    server, http, grpc_port = start_server(args.model, 1, *extra)
    try:
        role = roles(server.pid)
        groups: dict[str, list[int]] = {}
        for pid, r in role.items():
            if pid != os.getpid():
                key = r if r in ("frontend replica", "engine worker", "Redis") else "rest of the server"
                groups.setdefault(key, []).append(pid)
        if args.api == "grpc":
            call = client_call("grpc", http, grpc_port)  # request_timeline's: the same request
        else:
            raw = RawHttp(http)

            def call():
                raw.complete("m", PROMPT)
        for _ in range(50):
            call()
        before = {k: cpu(v) for k, v in groups.items()}
        lat = []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            call()
            lat.append(time.perf_counter() - t0)
        after = {k: cpu(v) for k, v in groups.items()}
    finally:
        stop_server(server)
    lat.sort()
    run = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "api": args.api,
           "router": args.router or "default", "requests": args.requests,
           "p50_ms": round(1e3 * lat[len(lat) // 2], 3),
           "cpu_ms_per_request": {k: round(1e3 * (after[k] - before[k]) / args.requests, 3) for k in sorted(before)}}
    print(json.dumps(run))
    doc = {"benchmark": "request_cpu", "command": " ".join(["python"] + sys.argv), "runs": []}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    doc["runs"].append(run)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
