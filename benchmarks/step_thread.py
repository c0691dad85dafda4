"""Does it matter which thread builds the engine? An `EngineWorker` runs every step on its
own thread; this measures the same worker with its engine built on the main thread (as it
was until 2026-12-02: loaded and warmed up there, then stepped on the step thread) and
built on the step thread itself (as now), each in a fresh process, in the order A B B A
repeated (this machine is noisy).

    python benchmarks/step_thread.py --model models/tiny-llama-8l [--rounds 2]

Per process: one request at a time (16-token prompt, 1 output token: a prefill step,
median of 40, run on the step thread) and 16 streams of 50 -> 100 tokens read in-process
(output tok/s, as serving_path_cost.py's in-process mode). Why it can matter: OpenMP
(libgomp here) keeps a thread pool per thread that ran a parallel region, and the main
thread's pool, left from loading, slowed the step thread's parallel regions (a silu on
16 x 2816 took ~40 us from either thread alone, ~57-63 us on a thread after the main one had
used OpenMP). Results: benchmarks/results/step_thread.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(model: str, where: str) -> dict:
    from serving_path_cost import drive, engine_config

    from folio.worker import LLMEngine, SamplingParams
    from folio.worker.actor import EngineWorker

    cfg = engine_config(model)
    if where == "main":
        built = LLMEngine(cfg)
        factory = lambda: built  # noqa: E731
    else:
        factory = functools.partial(LLMEngine, cfg)
    w = EngineWorker("w0", factory, None)

    def one_at_a_time(e) -> float:
        ts = []
        for i in range(45):
            t0 = time.perf_counter()
            e.add_request(f"p{i}", list(range(100, 116)), SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True))
            while e.has_unfinished_requests():
                e.step()
            ts.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(ts[5:])

    async def run() -> dict:
        async def timings():
            return await w._call(lambda e: dict(vars(e.timings)))
        prefill = await w._call(one_at_a_time)
        streams = await drive(w.generate, timings, 16)
        return {"prefill_ms_p50": round(prefill, 2), "streams16_tok_s": streams["output_tokens_per_s"],
                "streams16_forward_ms_per_step": streams["forward_ms_per_step"]}
    try:
        return asyncio.run(run())
    finally:
        w.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "step_thread.json"))
    args = ap.parse_args()
    if args.role:
        print(json.dumps(child(os.path.abspath(args.model), args.role)))
        return
    order = ["main", "step", "step", "main"] * args.rounds
    runs = []
    for where in order:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--role", where],
                             check=True, capture_output=True, text=True).stdout
        r = dict(json.loads(out.strip().splitlines()[-1]), built_on=where)
        print(r, flush=True)
        runs.append(r)
    summary = {}
    for where in ("main", "step"):
        mine = [r for r in runs if r["built_on"] == where]
        summary[where] = {k: round(statistics.fmean(r[k] for r in mine), 2)
                          for k in ("prefill_ms_p50", "streams16_tok_s", "streams16_forward_ms_per_step")}
    res = {"benchmark": "step_thread", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python benchmarks/step_thread.py " + " ".join(sys.argv[1:]),
           "cpu": os.popen("lscpu | grep 'Model name'").read().split(":")[-1].strip(),
           "order": order, "runs": runs, "mean": summary}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
