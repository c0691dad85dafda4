"""The main job's last step: `folio serve` on the tiny model (two Ray workers, embedded
Redis, HTTP + gRPC), driven by `folio bench`, then stopped with SIGTERM.

    python benchmarks/serve_local.py --model models/tiny-llama-8l [--requests 32] [--rate 8]

Runs two workloads through the OpenAI-compatible HTTP API (random lengths at a Poisson
rate; shared prefixes) and one through gRPC, and writes the harness's JSON for each to
benchmarks/results/serve_local_<workload>.json (plots under /tmp/folio-serve-local/).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    http, grpc_port = free_port(), free_port()
    folio = [sys.executable, "-m", "folio.deploy.cli"]
    server = subprocess.Popen(folio + ["serve", "--model", args.model, "--num-workers", str(args.workers),
                                       "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc_port),
                                       "--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "1024",
                                       "--router", "prefix-aware", "--namespace", "local", "--grace-period-s", "5"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    try:
        deadline = time.monotonic() + 300
        for line in server.stdout:
            if "folio serve: ready" in line:
                print(line.strip(), flush=True)
                break
            if time.monotonic() > deadline:
                raise SystemExit("folio serve did not start")
        else:
            raise SystemExit("folio serve exited before it was ready")
        plots = "/tmp/folio-serve-local"
        runs = [
            ("random", f"http://127.0.0.1:{http}", ["--rate", str(args.rate), "--input-len", "lognormal:60,0.8,400",
                                                   "--output-len", "lognormal:48,0.6,200"]),
            ("shared-prefix", f"http://127.0.0.1:{http}", ["--rate", str(args.rate), "--prefixes", "4",
                                                          "--prefix-len", "120", "--input-len", "uniform:8-40",
                                                          "--output-len", "uniform:16-64"]),
            ("multi-turn", f"grpc://127.0.0.1:{grpc_port}", ["--max-concurrency", "8", "--turns", "4",
                                                             "--input-len", "uniform:10-40", "--output-len",
                                                             "uniform:16-48"]),
        ]
        for workload, target, extra in runs:
            out = os.path.join(args.out_dir, f"serve_local_{workload}.json")
            r = subprocess.run(folio + ["bench", "--target", target, "--workload", workload, "--num-requests",
                                        str(args.requests), "--slo", "ttft=1.0,tpot=0.2", "--quiet", "--out", out,
                                        "--plots", plots, "--label", f"folio {workload}", *extra]
                               + (["--metrics-url", f"http://127.0.0.1:{http}/metrics"] if target.startswith("grpc")
                                  else []))
            if r.returncode != 0:
                return r.returncode
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            rest, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            rest = ""
        stopped = re.search(r"folio serve: stopped", rest or "")
        print("folio serve: stopped" if stopped else f"folio serve exit code {server.returncode}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
