"""Forward lanes (worker/forward_lanes.py) against one wide forward, by decode batch size.

For each batch size B: B requests of 50 random tokens -> 64, greedy, EOS ignored, prefilled in
one step and then decoded; the figure is the decode's mean ms per step. Two builds of the same
engine, each in a fresh process, in the order A B B A: `wide` (forward_lanes=1: one forward on
torch's threads, as before 2026-12-03) and `lanes` (forward_lanes=2, every batch of two or more
requests split: MIN_SEQS_PER_LANE=1). `--thief S` runs a process beside the engine that spins
S x 5 ms of every 5 ms (cpu_contention.py's), the shape of a server's other processes.

    python benchmarks/forward_lanes.py --model models/tiny-llama-8l [--batches 1,2,4,8,16,32,64,128]
        [--thief 0.3]

This picks forward_lanes.MIN_SEQS_PER_LANE: the smallest batch where the lanes are no slower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(model: str, mode: str, batches: list[int], thief: float) -> dict:
    import torch

    import folio.worker.forward_lanes as forward_lanes
    from folio.worker import SamplingParams
    from folio.worker.config import EngineConfig
    from folio.worker.engine import LLMEngine

    torch.set_num_threads(2)
    forward_lanes.MIN_SEQS_PER_LANE = 1
    e = LLMEngine(EngineConfig(model=model, block_size=16, num_kv_blocks=2048, max_num_seqs=256, warm_up=True,
                               forward_lanes=2 if mode == "lanes" else 1))
    rng = random.Random(0)
    proc = None
    if thief > 0:
        from cpu_contention import THIEF

        proc = subprocess.Popen([sys.executable, "-c", THIEF, str(thief), "5"])
    out = {}
    try:
        for b in batches:
            times = []
            for _ in range(2):
                for _ in range(b):
                    e.add_request(None, [rng.randrange(1, 8000) for _ in range(50)],
                                  SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
                e.step()  # the prefill
                t, steps = time.perf_counter(), 0
                while e.has_unfinished_requests():
                    e.step()
                    steps += 1
                times.append((time.perf_counter() - t) / steps * 1e3)
            out[str(b)] = round(sum(times) / len(times), 2)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--thief", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print("RESULT " + json.dumps(child(args.model, args.child, batches, args.thief)), flush=True)
        return 0
    runs = []
    for mode in ("wide", "lanes", "lanes", "wide"):
        p = subprocess.run([sys.executable, __file__, "--model", args.model, "--batches", args.batches,
                            "--thief", str(args.thief), "--child", mode], capture_output=True, text=True, timeout=1800)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            sys.stderr.write(p.stderr[-4000:])
            return 1
        runs.append({"mode": mode, "decode_ms_per_step": json.loads(line[0][7:])})
        print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for b in map(str, batches):
        mean = {m: sum(r["decode_ms_per_step"][b] for r in runs if r["mode"] == m) / 2 for m in ("wide", "lanes")}
        summary[b] = {"wide_ms": round(mean["wide"], 2), "lanes_ms": round(mean["lanes"], 2),
                      "lanes_over_wide": round(mean["lanes"] / mean["wide"], 3)}
    import data_plane

    result = {"benchmark": "forward_lanes", "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": data_plane._cpu(),
              "thief_share_of_one_core": args.thief, "order": "wide lanes lanes wide, a fresh process each",
              "workload": "B x 50 random tokens -> 64, greedy; decode ms per step (mean of 2 rounds)",
              "summary": summary, "runs": runs}
    out = args.out or os.path.join(HERE, "results", f"forward_lanes{'_thief' if args.thief else ''}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
