"""Where one request's time goes when `folio serve` runs it, thread by thread: the lead of
frontend_overhead.py's "added" milliseconds (issue #15).

One request at a time (16-token prompt, 1 output token, greedy), first on the engine alone in
this process, then through `folio serve` (one worker) over gRPC or HTTP. For each, every
thread's CPU, run-queue wait (runnable but not running, from /proc/*/task/*/schedstat),
voluntary and involuntary context switches, per request; served, for the engine worker, the
frontend replica and this process (the client). With `--perf`, `perf sched record -a` over
the served loop says who took a core from the forward: every time one of the worker's two
forward threads (`folio-step`: the step thread and its OpenMP thread) was preempted while the
step thread was running a step, the preempting thread (its process's role) and how long the
forward thread stayed off its core.

    python benchmarks/request_timeline.py --model models/tiny-llama-8l [--api grpc|http]
        [--requests 200] [--perf]

Results: benchmarks/results/request_timeline.json.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from frontend_overhead import pct  # noqa: E402
from serve_local import start_server, stop_server  # noqa: E402
from served_procs import engine_counters  # noqa: E402

PROMPT = list(range(100, 116))
SWITCH = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:\s+prev_comm=(.*?) prev_pid=(\d+) "
                    r"prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")


def threads(pid: int) -> dict[str, dict]:
    """Every thread of `pid`: name, CPU and run-queue wait (ns), switches (so far)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                st = f.read()
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                cpu_ns, wait_ns = (int(x) for x in f.read().split()[:2])
            with open(f"/proc/{pid}/task/{t}/status") as f:
                status = f.read()
        except (OSError, ValueError):  # ended meanwhile
            continue
        out[t] = {"name": st[st.index("(") + 1:st.rindex(")")], "cpu_ns": cpu_ns, "wait_ns": wait_ns,
                  "vol": int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0]),
                  "inv": int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])}
    return out


def per_request(before: dict, after: dict, n: int, min_us: float = 5.0) -> list[dict]:
    """Each thread's cost per request between two `threads()` readings (busiest first)."""
    rows = []
    for t, b in after.items():
        a = before.get(t)
        if a is None:
            continue
        cpu_us = (b["cpu_ns"] - a["cpu_ns"]) / n / 1e3
        if cpu_us < min_us:
            continue
        rows.append({"thread": f"{b['name']} ({t})", "cpu_us": round(cpu_us), "runqueue_wait_us":
                     round((b["wait_ns"] - a["wait_ns"]) / n / 1e3), "voluntary": round((b["vol"] - a["vol"]) / n, 1),
                     "involuntary": round((b["inv"] - a["inv"]) / n, 1)})
    return sorted(rows, key=lambda r: -r["cpu_us"])


def inprocess(model: str, n: int) -> dict:
    from folio.worker import LLM, SamplingParams

    llm = LLM(model, block_size=16, num_kv_blocks=256, max_model_len=1024, enable_prefix_caching=False)
    eng = llm.engine

    def one(i: int) -> None:
        eng.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    for i in range(10):
        one(i)
    before, f0, lat = threads(os.getpid()), eng.timings.forward, []
    for i in range(n):
        t = time.perf_counter()
        one(100 + i)
        lat.append(time.perf_counter() - t)
    return {"p50_ms": round(1e3 * pct(lat, 50), 2),
            "forward_ms_per_step": round(1e3 * (eng.timings.forward - f0) / n, 2),
            "threads": per_request(before, threads(os.getpid()), n)}


def roles(root: int) -> dict[int, str]:
    """pid -> role of every process of the server's tree, and this one (the client)."""
    import psutil

    out = {os.getpid(): "client (this process)"}
    for p in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for key, role in (("EngineWorker", "engine worker"), ("FolioFrontend", "frontend replica"),
                          ("Coordinator", "coordinator"), ("ServeController", "Serve controller"),
                          ("raylet", "raylet"), ("gcs_server", "GCS"), ("redis", "Redis"),
                          ("dashboard", "Ray dashboard / agents"), ("folio.deploy.cli", "folio serve driver")):
            if key in cmd:
                out[p.pid] = role
                break
        else:
            out[p.pid] = "other Ray process"
    return out


def client_call(api: str, http: int, grpc_port: int):
    if api == "grpc":
        import grpc

        from folio.v1 import generate_pb2 as pb
        from folio.v1 import generate_pb2_grpc as pbg
        stub = pbg.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        req = pb.GenerateRequest(sampling=pb.SamplingParameters(max_tokens=1, temperature=0, ignore_eos=True))
        req.token_ids.ids.extend(PROMPT)
        return lambda: stub.Generate(req)
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0)
    return lambda: client.completions.create(model="m", prompt=PROMPT, max_tokens=1, temperature=0,
                                             extra_body={"ignore_eos": True})


def preemptors(trace: str, pid_of: dict[str, int], role_of: dict[int, str], forward: tuple[str, str],
               windows_min: int = 1) -> dict:
    """From `perf script` sched_switch lines: the forward threads' preemptions while the
    step thread was between waking and sleeping again, by preemptor."""
    step, omp = forward
    active, windows, off = False, 0, {}
    count: collections.Counter = collections.Counter()
    lost: collections.Counter = collections.Counter()
    for line in trace.splitlines():
        m = SWITCH.search(line)
        if not m:
            continue
        _, t, _, prev, state, next_comm, nxt = m.groups()
        if nxt in off:
            who, t_off, during = off.pop(nxt)
            if during:
                lost[who] += float(t) - t_off
        if nxt == step and not active:
            active, windows = True, windows + 1
        if prev == step and state.startswith("S"):
            active = False
        if prev in (step, omp) and state.startswith("R"):
            who = f"{role_of.get(pid_of.get(nxt, -1), 'other')}: {next_comm}"
            off[prev] = (who, float(t), active)
            if active:
                count[who] += 1
    n = max(windows, windows_min)
    top = sorted(count, key=lambda k: -lost[k])[:15]
    return {"step_windows": windows, "preemptions_per_window": round(sum(count.values()) / n, 2),
            "off_cpu_ms_per_window": round(1e3 * sum(lost.values()) / n, 3),
            "by_preemptor": [{"who": k, "per_window": round(count[k] / n, 2),
                              "off_cpu_ms_per_window": round(1e3 * lost[k] / n, 3)} for k in top]}


def served(model: str, n: int, api: str, perf: bool) -> dict:
    import psutil

    srv, http, grpc_port = start_server(model, 1, "--block-size", "16", "--num-kv-blocks", "256",
                                        "--max-model-len", "1024", "--router", "least-loaded",
                                        "--served-model-name", "m")
    try:
        call = client_call(api, http, grpc_port)
        for _ in range(20):
            call()
        role_of = roles(srv.pid)
        worker = next(p for p, r in role_of.items() if r == "engine worker")
        replica = next(p for p, r in role_of.items() if r == "frontend replica")
        time.sleep(0.3)  # the worker's counters reach /metrics with its heartbeat
        c0 = engine_counters(http)
        data = os.path.join(tempfile.mkdtemp(prefix="folio-timeline-"), "sched.data")
        rec = (subprocess.Popen(["perf", "sched", "record", "-a", "-o", data], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) if perf else None)
        if rec:
            time.sleep(1.0)
        before = {p: threads(p) for p in (worker, replica, os.getpid())}
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            call()
            lat.append(time.perf_counter() - t)
        after = {p: threads(p) for p in (worker, replica, os.getpid())}
        if rec:
            rec.send_signal(2)
            rec.wait(60)
        time.sleep(0.5)
        c1 = engine_counters(http)
        steps = c1["steps"] - c0["steps"]
        doc = {"api": api, "p50_ms": round(1e3 * pct(lat, 50), 2),
               "forward_ms_per_step": round(1e3 * (c1["forward"] - c0["forward"]) / max(steps, 1), 2),
               "steps": int(steps),
               "threads": {role_of[p]: per_request(before[p], after[p], n) for p in before}}
        if rec:
            pid_of = {t: p for p in role_of for t in (os.listdir(f"/proc/{p}/task") if psutil.pid_exists(p) else [])}
            fwd = sorted(t for t, v in after[worker].items() if v["name"] == "folio-step")
            trace = subprocess.run(["perf", "script", "-i", data, "-F", "cpu,time,event,trace"],
                                   capture_output=True, text=True).stdout
            # the step thread sleeps between requests; its OpenMP thread spins through the gaps
            step = max(fwd, key=lambda t: after[worker][t]["vol"] - before[worker].get(t, after[worker][t])["vol"])
            doc["forward_preemptions"] = preemptors(trace, pid_of, role_of, (step, next(t for t in fwd if t != step)))
            os.remove(data)
        return doc
    finally:
        stop_server(srv)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--api", choices=("grpc", "http"), default="grpc")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--perf", action="store_true", help="attribute the forward's preemptions (perf sched)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "request_timeline.json"))
    args = ap.parse_args()
    doc = {"benchmark": "request_timeline", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "requests": args.requests,
           "inprocess": inprocess(args.model, args.requests)}
    doc["served"] = served(args.model, args.requests, args.api, args.perf)
    print(json.dumps(doc, indent=2))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
