"""How much of the engine's speed another process's CPU takes on this machine: the lead of #15.

Behind `folio serve` the engine's forward slows more than the CPU the other processes use
(frontend replica, load client, Ray / Redis / Serve: ~18 % of the 2 cores, a 22-33 % loss).
This measures that amplification without the server: the in-process `EngineWorker` of
serving_path_cost.py (64 streams of 2 x 50 -> 100 tokens, greedy) with a "thief" beside it,
one process that wakes every PERIOD ms and spins for SHARE x PERIOD (the shape of a frontend
that handles one frame per engine step), each run in a fresh process, in the order
A B B A (the machine is noisy). Reports output tok/s, forward ms per step and the machine's
idle fraction during the timed part (how much CPU the engine leaves for others at all).

    python benchmarks/cpu_contention.py --model models/tiny-llama-8l [--shares 0,0.3] [--period-ms 5]
        [--env GOMP_SPINCOUNT=10000]   # a variant of the engine's environment, run as its own mode
        [--engines folio,vllm]         # also vLLM's offline LLM on the same requests (its venv)

The amplification is (1 - tok/s with thief / tok/s without) / (share / cores): 1 means the
engine loses exactly the CPU the thief takes, 2 that both OpenMP threads wait for the one the
thief preempted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import data_plane  # benchmarks/: its _cpu() names the machine

HERE = os.path.dirname(os.path.abspath(__file__))
THIEF = r"""
import sys, time
share, period = float(sys.argv[1]), float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    end = t + share * period
    while time.perf_counter() < end:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - t)))
"""


def _cpu_stat() -> tuple[int, int]:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return v[3] + v[4], sum(v)  # idle + iowait, all


def child_vllm(model: str, share: float, period_ms: float, streams: int) -> dict:
    """vLLM's offline `LLM` (its own engine-core process) on the same requests, the thief beside
    the timed `generate` only: is its forward as sensitive to a stolen core as Folio's?"""
    import serving_path_cost as spc
    from vllm import LLM, SamplingParams

    llm = LLM(max_num_seqs=streams, **spc.vllm_args(model))
    params = SamplingParams(max_tokens=spc.OUTPUT, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in spc.vllm_prompts(1 + streams * spc.ROUNDS)]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    thief = (subprocess.Popen([sys.executable, "-c", THIEF, str(share), str(period_ms)])
             if share > 0 else None)
    s0 = _cpu_stat()
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
    finally:
        wall = time.perf_counter() - t0
        s1 = _cpu_stat()
        if thief:
            thief.kill()
            thief.wait()
    return {"output_tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / wall, 1),
            "machine_idle_fraction": round((s1[0] - s0[0]) / max(1, s1[1] - s0[1]), 3)}


def child(model: str, share: float, period_ms: float, streams: int) -> dict:
    """One run in this process: the engine, and the thief beside it for the whole drive (its one
    warm-up request and the timed part; the idle fraction covers the same span)."""
    import serving_path_cost as spc

    spc.STREAMS = [streams]
    box: dict = {}
    drive = spc.drive

    async def timed_drive(*args):
        thief = (subprocess.Popen([sys.executable, "-c", THIEF, str(share), str(period_ms)])
                 if share > 0 else None)
        s0 = _cpu_stat()
        try:
            return await drive(*args)
        finally:
            s1 = _cpu_stat()
            box["machine_idle_fraction"] = round((s1[0] - s0[0]) / max(1, s1[1] - s0[1]), 3)
            if thief:
                thief.kill()
                thief.wait()

    spc.drive = timed_drive
    out = spc.run_inprocess(model)[streams]
    return {**out, **box}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--shares", default="0,0.3", help="the thief's share of one core, comma-separated")
    ap.add_argument("--period-ms", type=float, default=5.0)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE: also run the engine with it")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_contention.json"))
    ap.add_argument("--engines", default="folio", help="folio and/or vllm (vLLM's offline LLM, its venv)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--child-engine", default="folio", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        share, period, streams = args.child
        run = child_vllm if args.child_engine == "vllm" else child
        print("RESULT " + json.dumps(run(args.model, float(share), float(period), int(streams))), flush=True)
        return 0

    import serving_path_cost as spc

    shares = [float(s) for s in args.shares.split(",")]
    variants = [("default", {})] + [(e, dict([e.split("=", 1)])) for e in args.env]
    if "vllm" in args.engines.split(","):
        if not os.path.exists(spc.VLLM_PY):
            raise SystemExit("no vLLM venv: run benchmarks/vs_peers_offline.py --setup-vllm first")
        variants.append(("vllm", spc.VLLM_ENV))
    if "folio" not in args.engines.split(","):
        variants = [v for v in variants if v[0] == "vllm"]
    modes = [(name, env, s) for name, env in variants for s in shares]
    runs = []
    for name, env, share in modes + modes[::-1]:  # A B B A
        vllm = name == "vllm"  # in vLLM's venv, outside the checkout (its kernels/ shadows vLLM's import)
        proc = subprocess.run([spc.VLLM_PY if vllm else sys.executable, os.path.abspath(__file__),
                               "--model", os.path.abspath(args.model), "--child", str(share),
                               str(args.period_ms), str(args.streams), "--child-engine", "vllm" if vllm else "folio"],
                              env=dict(os.environ, **env), capture_output=True, text=True, timeout=1800,
                              cwd=tempfile.gettempdir() if vllm else None)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.stderr.write(proc.stderr[-4000:])
            return 1
        r = {"variant": name, "thief_share_of_one_core": share, **json.loads(line[0][7:])}
        print(json.dumps(r), flush=True)
        runs.append(r)

    summary = {}
    cores = os.cpu_count() or 1
    for name, _ in variants:
        base = [r["output_tokens_per_s"] for r in runs if r["variant"] == name and r["thief_share_of_one_core"] == 0]
        for share in shares:
            got = [r["output_tokens_per_s"] for r in runs if r["variant"] == name and r["thief_share_of_one_core"] == share]
            mean = sum(got) / len(got)
            row = {"output_tokens_per_s_mean": round(mean, 1), "runs": got}
            if base and share > 0:
                loss = 1 - mean / (sum(base) / len(base))
                row["loss"] = round(loss, 3)
                row["amplification"] = round(loss / (share / cores), 2)
            summary[f"{name} thief={share}"] = row
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": data_plane._cpu(), "cores": cores, "streams": args.streams,
              "period_ms": args.period_ms, "order": "A B B A, a fresh process per run", "summary": summary,
              "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
