"""New connections while a frontend replica is killed: how many fail, with the kernel's
net.ipv4.tcp_migrate_req off and on, alternating (A B B A ...).

    python benchmarks/replica_kill_connections.py --model models/tiny-llama-8l [--rounds 8]

The replicas share the HTTP port with SO_REUSEPORT: each has its own listening socket and
accept queue, and the kernel hashes every new connection to one of them. A replica that dies
takes the connections queued on it (handshake done, not yet accepted): the kernel resets them,
unless tcp_migrate_req=1 (Linux 5.14+), which moves them to another socket of the group. The
same holds for a replica that closes its socket at the start of a drain (replica_drain.py).

Each round: `folio serve --frontend-replicas 2`, 4 client threads opening a new connection for
each GET /v1/models for 4 s, one replica SIGKILLed at 1 s; then wait for Serve's replacement.
The sysctl is per network namespace and needs root: the script sets it, and restores it at
the end. Writes benchmarks/results/replica_kill_connections.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_local import start_server, stop_server  # noqa: E402

SYSCTL = "/proc/sys/net/ipv4/tcp_migrate_req"
REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


def one(port: int) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(REQUEST)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        return "ok" if got.startswith(b"HTTP/1.1 200") else "other"
    except ConnectionResetError:
        return "reset"
    except ConnectionRefusedError:
        return "refused"
    except (socket.timeout, TimeoutError):
        return "timeout"
    except OSError as e:
        return f"oserror {e.errno}"


def replicas(server) -> list[psutil.Process]:
    return [c for c in psutil.Process(server.pid).children(recursive=True)
            if "ServeReplica" in " ".join(c.cmdline())]


def listeners(port: int) -> int:
    return sum(1 for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN")


def wait_two(server, port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (len(replicas(server)) == 2 and listeners(port) == 2 and one(port) == "ok"):
        if time.monotonic() > deadline:
            raise SystemExit("no second replica")
        time.sleep(0.5)
    time.sleep(2)  # the new replica past its first requests


def round_(server, port: int, threads: int, window_s: float, kill_at_s: float) -> dict:
    outcomes: list[tuple[float, str]] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def client():
        while (now := time.monotonic() - t0) < window_s:
            r = one(port)
            with lock:
                outcomes.append((now, r))
    ts = [threading.Thread(target=client) for _ in range(threads)]
    for t in ts:
        t.start()
    time.sleep(kill_at_s)
    random.choice(replicas(server)).kill()
    for t in ts:
        t.join()
    tally: dict[str, int] = {}
    for _, r in outcomes:
        tally[r] = tally.get(r, 0) + 1
    return {"connections": len(outcomes), **tally}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "replica_kill_connections.json"))
    args = ap.parse_args()
    with open(SYSCTL) as f:
        original = f.read().strip()
    order = [(0, 1, 1, 0)[i % 4] for i in range(args.rounds)]  # A B B A
    server, http, _ = start_server(args.model, 1, "--frontend-replicas", "2", "--grace-period-s", "1",
                                   "--block-size", "16", "--num-kv-blocks", "64", "--max-model-len", "512")
    rounds = []
    try:
        for migrate in order:
            wait_two(server, http)
            with open(SYSCTL, "w") as f:
                f.write(str(migrate))
            r = {"tcp_migrate_req": migrate, **round_(server, http, args.threads, 4.0, 1.0)}
            print(json.dumps(r), flush=True)
            rounds.append(r)
    finally:
        with open(SYSCTL, "w") as f:
            f.write(original)
        stop_server(server)
    summary = {}
    for m in (0, 1):
        rs = [r for r in rounds if r["tcp_migrate_req"] == m]
        summary[str(m)] = {"rounds": len(rs), "connections": sum(r["connections"] for r in rs),
                           "failed": sum(r["connections"] - r.get("ok", 0) for r in rs),
                           "failed_per_kill": [r["connections"] - r.get("ok", 0) for r in rs]}
    out = {"benchmark": "replica_kill_connections", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cpu": platform.processor() or platform.machine(), "kernel": platform.release(),
           "threads": args.threads, "window_s": 4.0, "kill_at_s": 1.0, "rounds": rounds, "summary": summary}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
