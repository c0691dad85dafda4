"""One prompt at a time, no other load: the time from add to the first token (a prefill and
its sample) of Folio's engine and vLLM's offline `LLM`, by prompt length. What TTFT at a low
request rate is made of once the serving path is taken out (issue #15's TTFT target).

    python benchmarks/prefill_latency.py --model models/tiny-llama-8l [--lengths 64,256,512] [--rounds 2]

Each engine runs in a fresh process of its own (vLLM from .venv-vllm, as vs_peers_offline.py
sets it up, float32, its CPU threads bound as its docs say), folio vLLM vLLM folio per round;
random token ids, prefix caching off, 20 prompts per length after 5 warm-ups, median.
Each engine's first run also profiles 5 prompts by op (the torch profiler; vLLM's through its
own profiler_config), ms per prompt, at 512 tokens (else the longest length): vLLM's table never
came at 1,000 tokens.
Results: benchmarks/results/prefill_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_PY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
VLLM_ENV = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="1",
                HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
PROMPTS, WARM = 20, 5


def run_engine(engine: str, model: str, lengths: list[int], profile: bool) -> dict:
    """In this process (a child of main): ms from add to first token, per length."""
    import random

    random.seed(0)
    if engine == "folio":
        from folio.worker import LLM, SamplingParams

        eng = LLM(model, block_size=16, num_kv_blocks=512, max_model_len=1024, enable_prefix_caching=False).engine
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        count = iter(range(10**9))

        def one(ids):
            eng.add_request(f"r{next(count)}", ids, sp)
            while eng.has_unfinished_requests():
                eng.step()
    else:
        import tempfile

        from vllm import LLM, SamplingParams

        trace_dir = tempfile.mkdtemp(prefix="folio-vllm-prof-")
        llm = LLM(model, dtype="float32", max_model_len=1024, enable_prefix_caching=False, block_size=32,
                  num_gpu_blocks_override=8192 // 32, max_num_seqs=64, seed=0,
                  profiler_config={"profiler": "torch", "torch_profiler_dir": trace_dir} if profile else None)
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

        def one(ids):
            llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)

    def timed(n):
        ids = [random.randrange(1000, 8000) for _ in range(n)]
        t = time.perf_counter()
        one(ids)
        return 1e3 * (time.perf_counter() - t)
    for _ in range(WARM):
        timed(max(lengths))
    profile_len = 512 if 512 in lengths else max(lengths)
    doc = {"ms_p50": {str(n): round(statistics.median(timed(n) for _ in range(PROMPTS)), 2) for n in lengths}}
    if profile and engine == "folio":
        from torch.profiler import profile as torch_profile

        with torch_profile() as prof:
            for _ in range(5):
                timed(profile_len)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        doc["profile"] = {e.key: {"ms_per_prompt": round(e.self_cpu_time_total / 5e3, 2)} for e in ops[:8]}
    elif profile:  # vLLM's engine core profiles itself (torch profiler) and writes its table
        llm.start_profile()
        for _ in range(5):
            timed(profile_len)
        llm.stop_profile()
        doc["profile"] = vllm_ops(trace_dir, 5)
    return doc


def vllm_ops(trace_dir: str, prompts: int, top: int = 8) -> dict:
    """The largest ops of the table vLLM's profiler writes (rank0.profiler_out.txt), per prompt;
    Python frames and the engine core's waits left out."""
    path = os.path.join(trace_dir, "rank0.profiler_out.txt")
    for _ in range(90):  # written by the engine core after stop_profile returns
        if os.path.exists(path):
            break
        time.sleep(1)
    else:  # seen at 1,000 tokens: the table never came (the timings stand without it)
        return {}
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    out = {}
    for line in open(path):
        cols = [c for c in line.rstrip("\n").split("  ") if c.strip()]
        name = cols[0].strip() if cols else ""
        if len(cols) < 7 or ".py" in name or name.startswith(("/", "vllm/", "<built-in method")):
            continue
        self_cpu = cols[2].strip()
        unit = next((u for u in ("us", "ms", "s") if self_cpu.endswith(u)), None)
        if unit is None:
            continue
        out[name] = {"ms_per_prompt": round(float(self_cpu[:-len(unit)]) * units[unit] / prompts, 2)}
        if len(out) == top:
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="64,256,512")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefill_latency.json"))
    ap.add_argument("--child", choices=["folio", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model = os.path.abspath(args.model)
    if args.child:
        print("RESULT " + json.dumps(run_engine(args.child, model, lengths, args.profile)), flush=True)
        return 0
    runs = []
    for r in range(args.rounds):
        for engine in ("folio", "vllm", "vllm", "folio"):
            python, env = (VLLM_PY, VLLM_ENV) if engine == "vllm" else (sys.executable, dict(os.environ, HF_HUB_OFFLINE="1"))
            cmd = [python, os.path.abspath(__file__), "--model", model, "--lengths", args.lengths, "--child", engine]
            if r == 0 and not any(x["engine"] == engine for x in runs):  # each engine's first run
                cmd.append("--profile")
            # vLLM from outside the checkout: the checkout's kernels/ shadows a package it imports
            done = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stderr[-6000:])
                raise SystemExit(f"{engine} exited {done.returncode}")
            out = done.stdout
            doc = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs.append({"round": r, "engine": engine, **doc})
            print(engine, doc["ms_p50"], flush=True)
    summary = {}
    for n in lengths:
        f = statistics.mean(x["ms_p50"][str(n)] for x in runs if x["engine"] == "folio")
        v = statistics.mean(x["ms_p50"][str(n)] for x in runs if x["engine"] == "vllm")
        summary[str(n)] = {"folio_ms": round(f, 1), "vllm_ms": round(v, 1), "folio_over_vllm": round(f / v, 3)}
    doc = {"benchmark": "prefill_latency", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "order": "folio vllm vllm folio per round, a process each",
           "summary": summary,
           "profile_tokens": 512 if 512 in lengths else max(lengths),
           "profile_ms_per_prompt": {e: next((x["profile"] for x in runs
                                                         if x["engine"] == e and "profile" in x), {})
                                                for e in ("folio", "vllm")},
           "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
