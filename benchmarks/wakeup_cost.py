"""What wake-ups alone cost a forward on this machine (issue #15: is it the idle cluster's
wake-ups, or its CPU, that slows the served engine?).

    python benchmarks/wakeup_cost.py --model models/tiny-llama-8l [--rounds 2] [--idle-server]

The engine in this process decodes 16 requests of 50 -> 100 tokens (greedy) per run, its output
tok/s timed, while one of these runs beside it, alternated with nothing beside it (A B B A):

- gil-thread: a thread in this process that wakes every 10 ms and takes the GIL, as Ray's core
  worker does in every actor process (its signal check, a period no setting changes);
- procs=N: N other processes that wake every 10 ms each (a sleep loop), N x 100 wake-ups a
  second and next to no CPU.

--idle-server also starts a `folio serve` (one worker) and counts, over 10 s of it idle, the
wake-ups (voluntary + involuntary context switches) and CPU of each of its threads, from /proc.
Results: benchmarks/results/wakeup_cost.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TICK = "import time\nwhile True:\n    time.sleep(0.01)"


class Beside:
    """Starts and stops what runs beside the engine for one variant."""

    def __init__(self, variant: str) -> None:
        self.variant, self.procs, self.thread, self.stop = variant, [], None, False

    def __enter__(self):
        if self.variant == "gil-thread":
            def tick() -> None:
                while not self.stop:
                    time.sleep(0.01)
            self.thread = threading.Thread(target=tick, daemon=True)
            self.thread.start()
        elif self.variant.startswith("procs="):
            n = int(self.variant.split("=", 1)[1])
            self.procs = [subprocess.Popen([sys.executable, "-c", TICK]) for _ in range(n)]
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.stop = True
        if self.thread is not None:
            self.thread.join()
        for p in self.procs:
            p.kill()
            p.wait()


def engine_runs(model: str, variants: list[str], rounds: int) -> dict:
    from folio.worker import LLM, SamplingParams

    eng = LLM(model, block_size=16, num_kv_blocks=2048, max_model_len=1024).engine
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    def run() -> float:
        for i in range(16):
            eng.add_request(None, list(range(100 + i, 150 + i)), params)
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return 16 * 100 / (time.perf_counter() - t)

    run()  # warm
    out: dict[str, list[float]] = {v: [] for v in ["nothing"] + variants}
    for v in variants:
        for r in range(rounds):
            for which in (["nothing", v] if r % 2 == 0 else [v, "nothing"]):
                with Beside(which):
                    out[which].append(round(run(), 1))
                print(json.dumps({"variant": which, "against": v, "tok_s": out[which][-1]}), flush=True)
    base = statistics.mean(out["nothing"])
    return {v: {"tok_s": xs, "mean": round(statistics.mean(xs), 1), "over_nothing": round(statistics.mean(xs) / base, 3)}
            for v, xs in out.items()}


def _threads(root: int) -> dict:
    import psutil

    out = {}
    for p in [psutil.Process(root)] + psutil.Process(root).children(recursive=True):
        try:
            proc = os.path.basename((p.cmdline() or [p.name()])[0])[:48]
        except psutil.Error:
            continue
        for tid in os.listdir(f"/proc/{p.pid}/task") if os.path.isdir(f"/proc/{p.pid}") else []:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                    st = f.read()
                with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{p.pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            switches = sum(int(line.split()[1]) for line in st.splitlines() if "ctxt_switches" in line)
            out[(p.pid, proc, int(tid), name)] = (switches, int(fields[11]) + int(fields[12]))
    return out


def idle_server(model: str, seconds: float = 10.0) -> dict:
    from frontend_overhead import start_one_worker

    server, _, _ = start_one_worker(model, "wakeups")
    try:
        time.sleep(15)  # past the start's own work
        a = _threads(server.pid)
        time.sleep(seconds)
        b = _threads(server.pid)
    finally:
        os.kill(server.pid, signal.SIGINT)
        server.wait(60)
    hz = os.sysconf("SC_CLK_TCK")
    per_proc: dict = collections.defaultdict(lambda: {"wakeups_per_s": 0.0, "cpu_pct_of_one_core": 0.0})
    per_thread = []
    for k, (sw, cpu) in b.items():
        if k not in a:
            continue
        w, c = (sw - a[k][0]) / seconds, 100.0 * (cpu - a[k][1]) / hz / seconds
        per_proc[k[1]]["wakeups_per_s"] += w
        per_proc[k[1]]["cpu_pct_of_one_core"] += c
        if w >= 5 or c >= 0.2:
            per_thread.append({"process": k[1], "thread": k[3], "wakeups_per_s": round(w), "cpu_pct_of_one_core": round(c, 2)})
    return {"seconds": seconds,
            "total_wakeups_per_s": round(sum(p["wakeups_per_s"] for p in per_proc.values())),
            "total_cpu_pct_of_one_core": round(sum(p["cpu_pct_of_one_core"] for p in per_proc.values()), 2),
            "per_process": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in
                            sorted(per_proc.items(), key=lambda kv: -kv[1]["wakeups_per_s"])},
            "busiest_threads": sorted(per_thread, key=lambda t: -t["wakeups_per_s"])[:20]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--variants", default="gil-thread,procs=4,procs=12", help="'' : none (with --idle-server)")
    ap.add_argument("--rounds", type=int, default=2, help="A B B A pairs per variant, halved (2: A B, B A)")
    ap.add_argument("--idle-server", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "wakeup_cost.json"))
    args = ap.parse_args()
    doc = {"benchmark": "wakeup_cost", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python " + " ".join(sys.argv), "cpus": os.cpu_count(),
           "engine_tok_s": engine_runs(args.model, args.variants.split(","), args.rounds) if args.variants else None}
    if args.idle_server:
        doc["idle_folio_serve"] = idle_server(args.model)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
