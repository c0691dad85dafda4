"""The C++ CPU decode attention (kernels/cpu_attention.py) against the torch reference's gather +
SDPA: the op alone per layer, then the engine's decode step, builds alternated A B B A.

    python benchmarks/cpu_attention.py [--models models/tiny-llama-8l,<SmolLM2 GGUF>] [--rounds 2]

Op: one layer's decode attention over a block-major cache (the engine's strided layout), blocks
scattered at random; the figure is the median of 30 calls, and `kv_gb_s` is the K/V bytes the
contexts hold over that time (each read once by the kernel; the reference writes them to its
gather buffer and reads them again). Engine: `--batch` requests of `--context` prompt tokens,
prefilled, then the median of `--steps` decode steps, with FOLIO_ATTENTION_BACKEND=torch or cpp
(the model loaded once per backend). Results: benchmarks/results/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logits_processing import time_call  # noqa: E402  (median seconds of a call, after 3 warm-ups)

SHAPES = {  # name: (heads, kv heads, head dim, batch, context)
    "SmolLM2-135M b64 x 160": (9, 3, 64, 64, 160),
    "tiny-llama-8l b64 x 128": (8, 4, 64, 64, 128),
    "SmolLM2-135M b16 x 1000": (9, 3, 64, 16, 1000),
}


def op_case(heads, kv_heads, head_dim, batch, ctx, block_size=16, layers=30):
    from folio.kernels import cpu_attention, reference

    g = torch.Generator().manual_seed(0)
    per = -(-ctx // block_size)
    big = torch.randn(batch * per + 8, layers, 2, block_size, kv_heads, head_dim, generator=g)
    kc, vc = big[:, layers // 2, 0], big[:, layers // 2, 1]
    tables = torch.randperm(big.shape[0], generator=g)[: batch * per].view(batch, per).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g)
    kvb = 2 * kv_heads * head_dim * 4
    ref_plan = reference.plan_attention(tables, lens, qsl, block_size, kvb)
    cpp_plan = cpu_attention.plan(tables, lens, qsl, block_size, kvb)
    torch_fn = lambda: reference.paged_attention(q, kc, vc, tables, lens, qsl, head_dim ** -0.5, plan=ref_plan)  # noqa: E731
    cpp_fn = lambda: cpu_attention.paged_attention(q, kc, vc, tables, lens, qsl, head_dim ** -0.5, plan=cpp_plan)  # noqa: E731
    err = (torch_fn() - cpp_fn()).abs().max().item()
    return torch_fn, cpp_fn, batch * ctx * kvb, err


def engine_step_ms(model: str, backend: str, batch: int, context: int, steps: int) -> float:
    from folio.worker import LLM, SamplingParams

    os.environ["FOLIO_ATTENTION_BACKEND"] = backend
    try:
        llm = LLM(model, block_size=16, num_kv_blocks=batch * (context + steps + 40) // 16 + 64, max_model_len=2048,
                  max_num_seqs=256, enable_prefix_caching=False)
    finally:
        del os.environ["FOLIO_ATTENTION_BACKEND"]
    assert llm.engine.runner.model.ops.name == backend
    eng, rng = llm.engine, random.Random(0)
    vocab = len(llm.tokenizer)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(16, vocab) for _ in range(context)],
                        SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True, detokenize=False))
    while eng.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models/tiny-llama-8l")
    ap.add_argument("--rounds", type=int, default=2, help="A B B A rounds")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_attention.json"))
    args = ap.parse_args()
    doc = {"benchmark": "cpu_attention", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "threads": torch.get_num_threads(), "op": {}, "engine": {}}
    for name, shape in SHAPES.items():
        torch_fn, cpp_fn, kv_bytes, err = op_case(*shape)
        runs = {"torch": [], "cpp": []}
        for _ in range(args.rounds):
            for b in ("torch", "cpp", "cpp", "torch"):
                runs[b].append(round(1e3 * time_call(torch_fn if b == "torch" else cpp_fn, 30), 3))
        t, c = statistics.median(runs["torch"]), statistics.median(runs["cpp"])
        doc["op"][name] = {"ms_per_layer": runs, "speedup": round(t / c, 2), "max_abs_diff": err,
                           "kv_gb_s": {"torch": round(kv_bytes / t / 1e6, 1), "cpp": round(kv_bytes / c / 1e6, 1)}}
        print(name, doc["op"][name], flush=True)
    for model in [m for m in args.models.split(",") if m]:
        runs = {"torch": [], "cpp": []}
        for _ in range(args.rounds):
            for b in ("torch", "cpp", "cpp", "torch"):
                runs[b].append(round(engine_step_ms(model, b, args.batch, args.context, args.steps), 1))
        t, c = statistics.median(runs["torch"]), statistics.median(runs["cpp"])
        doc["engine"][os.path.basename(model)] = {
            "decode_step_ms": runs, "batch": args.batch, "context": args.context, "speedup": round(t / c, 2),
            "out_tok_s": {"torch": round(args.batch / t * 1e3), "cpp": round(args.batch / c * 1e3)}}
        print(model, doc["engine"][os.path.basename(model)], flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
