"""The main job's last step: `folio serve` on the tiny model (two Ray workers, embedded
Redis, HTTP + gRPC), driven by `folio bench`, then stopped with SIGTERM.

    python benchmarks/serve_local.py --model models/tiny-llama-8l [--requests 32] [--rate 8]

Runs two workloads through the OpenAI-compatible HTTP API (random lengths at a Poisson
rate; shared prefixes) and one through gRPC, and writes the harness's JSON for each to
OUT_DIR/serve_local_<workload>.json (`make run`: .run/results/; plots under /tmp/folio-serve-local/).
`start_server` / `stop_server` are shared with serve_smollm2.py (the real model).
"""

from __future__ import annotations

import argparse
import collections
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


def serve_command(model: str, workers: int, http: int, grpc_port: int, *extra: str) -> list[str]:
    """The `folio serve` command line on loopback ports (the benchmarks' one copy)."""
    return [sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model, "--num-workers", str(workers),
            "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc_port), *extra]


def start_server(model: str, workers: int, *extra: str, ready_timeout_s: float = 300.0):
    """`folio serve` on free loopback ports; returns (process, http port, grpc port) once it is ready."""
    http, grpc_port = free_port(), free_port()
    server = subprocess.Popen(serve_command(model, workers, http, grpc_port, *extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    deadline = time.monotonic() + ready_timeout_s
    seen: collections.deque = collections.deque(maxlen=40)  # its last lines, printed if it never gets ready
    try:
        for line in server.stdout:
            if "folio serve: ready" in line:
                print(line.strip(), flush=True)
                return server, http, grpc_port
            seen.append(line)
            if time.monotonic() > deadline:
                raise SystemExit("folio serve did not start; its last lines:\n" + "".join(seen))
        raise SystemExit("folio serve exited before it was ready; its last lines:\n" + "".join(seen))
    except BaseException:
        stop_server(server)
        raise


def stop_server(server) -> None:
    """SIGTERM, then up to 60 s to drain and stop (killed after that)."""
    server.send_signal(signal.SIGTERM)
    try:
        rest, _ = server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        rest, _ = server.communicate()
    stopped = re.search(r"folio serve: stopped", rest or "")
    print("folio serve: stopped" if stopped else f"folio serve exit code {server.returncode}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    folio = [sys.executable, "-m", "folio.deploy.cli"]
    server, http, grpc_port = start_server(args.model, args.workers, "--block-size", "16", "--num-kv-blocks", "256",
                                           "--max-model-len", "1024", "--router", "prefix-aware",
                                           "--namespace", "local", "--grace-period-s", "5")
    try:
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
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
