"""What an idle `folio serve` costs a forward beside it, and how much of the served forward's
slowdown that is (issue #15: the path overhead of one request).

    python benchmarks/background_cost.py --model models/tiny-llama-8l [--requests 150] [--rounds 2]

One-token requests (16-token prompt, greedy) on an engine in this process, its forward's ms per
step from the engine's own timers: first with no server, then beside a `folio serve` (one
worker) that idles, with parts of it stopped (SIGSTOP for the measured window, SIGCONT after):
`all` its whole process tree, `actors` the Ray actors (engine worker, frontend replica,
coordinator, Serve's controller), `daemons` the rest (raylet, GCS, Ray's agents, Redis, the
driver); and `served`: the same requests through the server over gRPC, its worker's forward per
step from /metrics. Variants alternate (A B C ... then reversed). Results:
benchmarks/results/background_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frontend_overhead import served_timings, start_one_worker, step_ms  # noqa: E402

PROMPT = list(range(100, 116))
VARIANTS = ("beside-idle-server", "all-stopped", "actors-stopped", "daemons-stopped", "served")


def tree(server: subprocess.Popen, which: str) -> list[int]:
    import psutil

    out = []
    for p in [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        actor = cmd.startswith("ray::") and "Agent" not in cmd
        if which == "all" or (which == "actors") == actor:
            out.append(p.pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "background_cost.json"))
    args = ap.parse_args()
    from folio.worker import LLM, SamplingParams

    eng = LLM(args.model, block_size=16, num_kv_blocks=256, max_model_len=1024).engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def inprocess() -> float:
        before = dataclasses.replace(eng.timings)
        for _ in range(args.requests):
            eng.add_request(None, PROMPT, params)
            while eng.has_unfinished_requests():
                eng.step()
        return step_ms(vars(before), vars(eng.timings))["forward"]

    inprocess()  # warm
    runs: dict[str, list[float]] = {"alone": [round(inprocess(), 2)]}
    server, http, grpc_port = start_one_worker(args.model, "bgcost")
    try:
        import grpc

        from folio.v1 import generate_pb2 as pb
        from folio.v1 import generate_pb2_grpc as pbg

        stub = pbg.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))

        def served(n: int) -> float:
            before = served_timings(http)
            for _ in range(n):
                req = pb.GenerateRequest(sampling=pb.SamplingParameters(max_tokens=1, temperature=0, ignore_eos=True))
                req.token_ids.ids.extend(PROMPT)
                stub.Generate(req)
            return step_ms(before, served_timings(http))["forward"]

        served(20)
        time.sleep(5)  # past the start's own work
        for r in range(args.rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                if v == "served":
                    ms = served(args.requests)
                else:
                    pids = tree(server, v.split("-")[0]) if v.endswith("stopped") else []
                    for p in pids:
                        os.kill(p, signal.SIGSTOP)
                    time.sleep(0.3)
                    try:
                        ms = inprocess()
                    finally:
                        for p in pids:
                            os.kill(p, signal.SIGCONT)
                runs.setdefault(v, []).append(round(ms, 2))
                print(v, runs[v][-1], flush=True)
                time.sleep(1.0)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    runs["alone-after"] = [round(inprocess(), 2)]
    doc = {"benchmark": "background_cost", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python " + " ".join(sys.argv), "requests": args.requests,
           "forward_ms_per_step": runs, "mean": {k: round(statistics.fmean(v), 2) for k, v in runs.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc["mean"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
