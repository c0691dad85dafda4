"""Offline throughput: paged vs contiguous KV at equal memory, and Hugging Face static batching.

Mixed-length workload: prompt and output lengths drawn from long-tailed (log-normal)
distributions, max_model_len 2048, every system given the same KV memory. Reports
output tokens/s, requests/s, average and peak running batch, KV waste
(1 - used slots / allocated slots, averaged over steps weighted by allocation) and a
profile of one decode step at batch 64 (how much is Python outside the forward).

    python benchmarks/offline_throughput.py --model models/tiny-llama-8l [--quick]

Writes benchmarks/results/offline_throughput[_quick].json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from folio.worker import LLM, SamplingParams  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def make_workload(n: int, vocab: int, max_model_len: int, seed: int,
                  max_prompt: int = 1536, max_output: int = 512) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; log-normal lengths, clipped to fit max_model_len."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = int(min(max(rng.lognormvariate(4.6, 0.9), 8), max_prompt))  # median ~100, long tail
        o = int(min(max(rng.lognormvariate(4.2, 0.9), 8), max_output))  # median ~67, long tail
        o = min(o, max_model_len - p)
        reqs.append(([rng.randrange(16, vocab) for _ in range(p)], o))
    return reqs


def run_engine(model: str, kv_manager: str, reqs, num_kv_blocks: int, block_size: int,
               max_model_len: int, max_num_seqs: int) -> dict:
    llm = LLM(model, block_size=block_size, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
              kv_manager=kv_manager, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    eng = llm.engine
    # warm-up outside the timed region
    llm.generate([reqs[0][0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for i, (prompt, out_len) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True,
                                                         detokenize=False))
    used_sum = alloc_sum = 0
    batches: list[int] = []
    out_tokens = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        live = eng.scheduler.running
        used, alloc = eng.kv.slot_stats(live)
        used_sum += used
        alloc_sum += alloc
        batches.append(len(live))
    elapsed = time.perf_counter() - t0
    stats = eng.stats()
    out_tokens = sum(o for _, o in reqs)
    assert stats.num_generated_tokens == out_tokens + 4, "every request must produce its output length"
    eng.check_invariants()
    return {
        "kv_manager": kv_manager,
        "seconds": round(elapsed, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "requests_per_s": round(len(reqs) / elapsed, 3),
        "avg_running_batch": round(statistics.fmean(batches), 2),
        "peak_running_batch": max(batches),
        "kv_waste": round(1 - used_sum / alloc_sum, 4),
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
    }


def run_hf_static(model: str, reqs, batch_size: int) -> dict:
    """transformers generate in static batches (left-padded; each batch runs to its longest output)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    # no EOS: every request runs to its output length, as for the engines
    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad, bos_token_id=None)
    useful = 0
    t0 = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        generation_config=gen_cfg)
        useful += sum(o for _, o in batch)
    elapsed = time.perf_counter() - t0
    return {
        "kv_manager": f"hf-static-batch-{batch_size}",
        "seconds": round(elapsed, 3),
        "output_tokens": useful,
        "output_tokens_per_s": round(useful / elapsed, 1),
        "requests_per_s": round(len(reqs) / elapsed, 3),
        "avg_running_batch": batch_size,
        "peak_running_batch": batch_size,
    }


def profile_decode_step(model: str, batch: int, prompt_len: int, steps: int, dtype: str = "float32") -> dict:
    """Time the phases of decode steps at a fixed batch; 'overhead' is everything but the forward."""
    llm = LLM(model, block_size=16, num_kv_blocks=batch * (prompt_len + steps + 32) // 16 + 16,
              max_model_len=2048, max_num_seqs=batch, dtype=dtype)
    eng = llm.engine
    rng = random.Random(1)
    for i in range(batch):
        eng.add_request(f"p{i}", [rng.randrange(16, 8000) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    before = vars(eng.timings).copy()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    after = vars(eng.timings)
    per = {k: (after[k] - before[k]) / steps * 1000 for k in ("schedule", "prepare", "forward", "sample", "postprocess")}
    overhead = wall * 1000 - per["forward"]
    return {
        "batch": batch, "context_tokens": prompt_len, "steps": steps,
        "ms_per_step": round(wall * 1000, 2),
        "ms_per_phase": {k: round(v, 3) for k, v in per.items()},
        "python_overhead_fraction": round(overhead / (wall * 1000), 4),
    }


def table(rows: list[dict]) -> str:
    head = ("| KV budget (tokens) | system | output tok/s | req/s | avg batch | peak batch | KV waste |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        waste = f"{100 * r['kv_waste']:.1f} %" if "kv_waste" in r else "n/a"
        lines.append(f"| {r['kv_tokens']} | {r['kv_manager']} | {r['output_tokens_per_s']} | {r['requests_per_s']} | "
                     f"{r['avg_running_batch']} | {r['peak_running_batch']} | {waste} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--quick", action="store_true", help="a small run for the README's main job")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--hf-requests", type=int, default=None, help="HF runs this prefix of the workload")
    ap.add_argument("--kv-tokens", default="8192,16384,32768",
                    help="KV memory budgets (comma-separated, in tokens); each is given to every system")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each system per budget, alternated (A B A B) so machine drift cancels")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    # quick: a one-minute smoke run for `make run` (tails clipped so one long request does
    # not decide it); the README's figures come from the full run
    n = args.num_requests or (64 if args.quick else 200)
    n_hf = args.hf_requests or (8 if args.quick else 48)
    budgets = [int(x) for x in args.kv_tokens.split(",")]
    if args.quick:
        budgets = budgets[1:2] or budgets
    from folio.worker.models.model_config import ModelConfig

    mc = ModelConfig.from_dir(args.model)
    reqs = (make_workload(n, mc.vocab_size, args.max_model_len, args.seed, max_prompt=256, max_output=96)
            if args.quick else make_workload(n, mc.vocab_size, args.max_model_len, args.seed))
    print(f"workload: {n} requests, prompt median {statistics.median(len(p) for p, _ in reqs)}, "
          f"output median {statistics.median(o for _, o in reqs)}; KV budgets {budgets} tokens", flush=True)

    results, summary = [], {}
    for kv_tokens in budgets:
        num_blocks = kv_tokens // args.block_size
        kv_mib = round(num_blocks * args.block_size * mc.kv_bytes_per_token(4) / 2**20, 1)
        runs: dict[str, list[dict]] = {"paged": [], "contiguous": []}
        for rnd in range(1 if args.quick else args.rounds):
            for mgr in ("paged", "contiguous"):
                r = run_engine(args.model, mgr, reqs, num_blocks, args.block_size, args.max_model_len,
                               args.max_num_seqs)
                r.update(kv_tokens=kv_tokens, kv_mib=kv_mib, round=rnd)
                print(r, flush=True)
                runs[mgr].append(r)
        for mgr, rs in runs.items():  # one row per system: throughput averaged over its rounds
            row = dict(rs[0])
            row["output_tokens_per_s"] = round(statistics.fmean(r["output_tokens_per_s"] for r in rs), 1)
            row["requests_per_s"] = round(statistics.fmean(r["requests_per_s"] for r in rs), 3)
            row["seconds"] = round(statistics.fmean(r["seconds"] for r in rs), 3)
            row["rounds_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in rs]
            row.pop("round")
            results.append(row)
        pairs = [p["output_tokens_per_s"] / c["output_tokens_per_s"] for p, c in zip(runs["paged"], runs["contiguous"])]
        summary[f"kv_{kv_tokens}"] = {
            "paged_vs_contiguous_throughput": round(statistics.fmean(pairs), 2),
            "paged_vs_contiguous_throughput_per_round": [round(x, 2) for x in pairs],
            "paged_vs_contiguous_avg_batch": round(runs["paged"][0]["avg_running_batch"]
                                                   / runs["contiguous"][0]["avg_running_batch"], 2),
        }
    # HF keeps its KV in a static batch that reserves each sequence's whole length:
    # with the middle budget's memory that is budget / max_model_len sequences.
    hf_kv = budgets[len(budgets) // 2]
    hf = run_hf_static(args.model, reqs[:n_hf], max(1, hf_kv // args.max_model_len))
    hf.update(kv_tokens=hf_kv)
    print(hf, flush=True)
    results.append(hf)
    paged_same = next(r for r in results if r["kv_manager"] == "paged" and r["kv_tokens"] == hf_kv)
    summary["paged_vs_hf_static_throughput"] = round(paged_same["output_tokens_per_s"] / hf["output_tokens_per_s"], 2)
    prof = profile_decode_step(args.model, batch=64, prompt_len=128, steps=4 if args.quick else 16)
    print(prof, flush=True)
    doc = {
        "benchmark": "offline_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "model": {"path": args.model, "hidden": mc.hidden_size, "layers": mc.num_layers, "heads": mc.num_heads,
                  "kv_heads": mc.num_kv_heads, "vocab": mc.vocab_size, "dtype": "float32"},
        "workload": {"requests": n, "hf_requests": n_hf, "seed": args.seed, "max_model_len": args.max_model_len,
                     "kv_tokens": budgets, "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                     "prompt_len_median": statistics.median(len(p) for p, _ in reqs),
                     "prompt_len_max": max(len(p) for p, _ in reqs),
                     "output_len_median": statistics.median(o for _, o in reqs),
                     "output_len_max": max(o for _, o in reqs)},
        "results": results,
        "summary": summary,
        "decode_step_profile": prof,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    os.makedirs(RESULTS, exist_ok=True)
    out = args.out or os.path.join(RESULTS, "offline_throughput_quick.json" if args.quick else "offline_throughput.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print()
    print(table(results))
    print()
    for k, v in summary.items():
        print(k, v)
    print(f"decode step at batch 64: {prof['ms_per_step']} ms, Python overhead outside the forward "
          f"{100 * prof['python_overhead_fraction']:.1f} %")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
