"""Where an engine step's time goes: the torch profiler over decode steps at a fixed batch (or
one prefill step), grouped by op and input shape.

    python benchmarks/profile_step.py --model DIR_OR_GGUF [--dtype bfloat16] [--batch 64]
        [--context 128] [--steps 10] [--prefill] [--rows 16]
        [--ab-small-ops | --ab-huge-pages [--rounds N] [--out FILE.json]]

It first times `--steps` steps without the profiler (the figure to compare between changes,
in an interleaved A/B: this machine drifts), then profiles as many and prints the table.

--ab-small-ops: no profile; decode steps alternate, in this one process, between the backend's
ops as they are and the same backend with the forward's small ops (norms, SiLU, rotary + KV
write) and the sampler's argmax on torch's reference chains (A B B A per round of --steps steps each): what
the fused C++ ops gain, free of the drift between processes.

--ab-huge-pages: the same alternation between the KV cache on 2 MB pages (as the runner
allocates it, worker/hugepages.py) and a copy of it on 4 KB pages (plain torch.zeros), the
cache's contents copied across at each switch, outside the timed steps.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def add_random_requests(eng, batch: int, context: int, max_tokens: int, prefix: str = "r", seed: int = 0) -> None:
    """`batch` greedy requests of `context` random prompt tokens (EOS ignored, no text)."""
    from folio.worker import SamplingParams

    rng, vocab = random.Random(seed), len(eng.tokenizer)
    for i in range(batch):
        eng.add_request(f"{prefix}{i}", [rng.randrange(16, vocab) for _ in range(context)],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False))


def prefill_all(eng) -> None:
    """Step until every request has its prompt computed: the next steps are decode steps."""
    while eng.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill", action="store_true", help="profile one prefill step instead of decode steps")
    ap.add_argument("--rows", type=int, default=16, help="rows of the profiler's table")
    ap.add_argument("--ab-small-ops", action="store_true", help="time fused vs reference small ops, alternated")
    ap.add_argument("--ab-huge-pages", action="store_true", help="time the KV cache on 2 MB vs 4 KB pages, alternated")
    ap.add_argument("--rounds", type=int, default=4, help="--ab-*: A B B A rounds")
    ap.add_argument("--out", help="--ab-*: write the figures here (JSON)")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from folio.worker import LLM

    ab = args.ab_small_ops or args.ab_huge_pages
    per_seq = args.context + 3 * args.steps + 32 + (4 * args.rounds * (args.steps + 1) if ab else 0)
    bs = args.block_size
    llm = LLM(args.model, dtype=args.dtype, block_size=bs, num_kv_blocks=args.batch * per_seq // bs + 64,
              max_model_len=2048, max_num_seqs=256, enable_prefix_caching=False)
    eng = llm.engine
    add_random_requests(eng, args.batch, args.context, 3 * args.steps + 8
                        + (4 * args.rounds * (args.steps + 1) if ab else 0))
    if args.ab_small_ops:
        return ab_small_ops(eng, args)
    if args.ab_huge_pages:
        return ab_huge_pages(eng, args)
    if args.prefill:
        eng.step()  # the first chunk: warm-up
        what = "prefill step"
        n = 1
    else:
        prefill_all(eng)
        for _ in range(3):
            eng.step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        print(f"{args.dtype} decode step at batch {args.batch}: {ms:.1f} ms -> {args.batch / ms * 1e3:.0f} tok/s")
        what = f"{args.steps} decode steps"
        n = args.steps
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(n):
            eng.step()
    print(f"torch profiler, {what}:")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                             max_name_column_width=36))


def alternate(eng, args, variants: dict, extra: dict) -> None:
    """Decode steps under each of two variants (name -> a function that switches to it), A B B A
    per round of --steps steps; the medians and every round's figure to stdout and --out."""
    import json
    import statistics

    (a, use_a), (b, use_b) = variants.items()
    prefill_all(eng)
    for _ in range(3):
        eng.step()
    ms: dict[str, list[float]] = {a: [], b: []}
    try:
        for _ in range(args.rounds):
            for which, use in ((a, use_a), (b, use_b), (b, use_b), (a, use_a)):
                use()
                eng.step()  # one step to settle
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                ms[which].append(round((time.perf_counter() - t0) / args.steps * 1e3, 2))
    finally:
        use_a()
    doc = {"benchmark": f"profile_step --ab-{extra.pop('ab')}", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "model": os.path.basename(args.model), "dtype": args.dtype, "batch": args.batch, "context": args.context,
           **extra, "decode_step_ms": ms, "median_ms": {k: statistics.median(v) for k, v in ms.items()}}
    print(json.dumps(doc, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)


def ab_small_ops(eng, args) -> None:
    import dataclasses

    from folio.kernels import reference
    from folio.worker import sampler

    model = eng.runner.model
    fused = model.ops
    ref = dataclasses.replace(fused, rms_norm=reference.rms_norm, add_rms_norm=reference.add_rms_norm,
                              silu_mul=reference.silu_mul, rope_write_kv=None)
    fused_argmax = sampler.cpu_ops.argmax_rows

    def use(ops, argmax):
        def switch():
            model.ops, sampler.cpu_ops.argmax_rows = ops, argmax
        return switch

    alternate(eng, args, {"fused": use(fused, fused_argmax), "reference": use(ref, lambda x: x.argmax(dim=-1))},
              {"ab": "small-ops", "backend": fused.name})


def ab_huge_pages(eng, args) -> None:
    import torch

    from folio.worker import hugepages

    runner = eng.runner
    huge = runner.kv_blocks
    small = torch.zeros(huge.shape, dtype=huge.dtype)
    if runner.kv_blocks.stride() != small.stride():
        raise SystemExit("--ab-huge-pages takes the default block-major cache layout")

    def use(cache):
        def switch():
            if runner.kv_blocks is not cache:
                cache.copy_(runner.kv_blocks)
                runner.kv_blocks = cache
                runner.kv_caches = [(cache[:, i, 0], cache[:, i, 1]) for i in range(cache.shape[1])]
        return switch

    alternate(eng, args, {"2 MB pages": use(huge), "4 KB pages": use(small)},
              {"ab": "huge-pages", "huge_page_bytes": {"2 MB pages": hugepages.huge_bytes(huge),
                                                       "4 KB pages": hugepages.huge_bytes(small)}})


if __name__ == "__main__":
    main()
