"""What logits processing costs the sampler: one `sample()` call on a batch of rows, with each
kind of processing on every row, against the same batch without any.

    .venv/bin/python benchmarks/logits_processing.py [--batch 64] [--vocab 49152] [--out F]

Rows carry a history of --prompt-len prompt and --output-len output tokens (what the penalties
count), one token longer at each call (a decode step). Reports the median of --repeats timed
calls after warm-up, per configuration, in ms, and the added cost per row. 49,152 is
SmolLM2-135M's vocabulary.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from folio.worker.sampler import sample  # noqa: E402
from folio.worker.sampling_params import SamplingParams  # noqa: E402


class Row:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.token_ids = prompt + output
        self.num_prompt_tokens = len(prompt)


def configs(rng: random.Random, vocab: int) -> dict[str, dict]:
    return {
        "none": {},
        "repetition_penalty": dict(repetition_penalty=1.2),
        "presence+frequency": dict(presence_penalty=0.5, frequency_penalty=0.5),
        "logit_bias (16 ids)": dict(logit_bias={rng.randrange(vocab): -5.0 for _ in range(16)}),
        "bad_words (8 words of 1-3 tokens)": dict(bad_words_token_ids=[[rng.randrange(vocab) for _ in range(
            rng.randint(1, 3))] for _ in range(8)]),
        "min_tokens (not reached)": dict(min_tokens=10_000, max_tokens=10_000, stop_token_ids=[1, 2]),
        "allowed_token_ids (1,000)": dict(allowed_token_ids=rng.sample(range(vocab), 1000)),
        "all of them": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                            logit_bias={rng.randrange(vocab): -5.0 for _ in range(16)},
                            bad_words_token_ids=[[rng.randrange(vocab)] for _ in range(8)],
                            min_tokens=10_000, max_tokens=10_000, allowed_token_ids=rng.sample(range(vocab), 1000)),
    }


TEXTS = ["The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and cafes.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
         "Write a short poem about the sea. The sea is wide and deep, its waves roll on and on to the shore."]


def smollm2_logits(batch: int) -> torch.Tensor:
    """[batch, 49152] next-token logits of SmolLM2-135M-Instruct at the positions of TEXTS."""
    from transformers import AutoModelForCausalLM

    from folio.worker.detokenizer import load_tokenizer
    sys.path.insert(0, os.path.dirname(__file__))
    from serve_smollm2 import smollm2_gguf
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("no SmolLM2 GGUF (make venv installs it): use --logits zipf")
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for t in TEXTS:
            rows.append(model(tok(t, return_tensors="pt").input_ids).logits[0].float())
    rows = torch.cat(rows)
    return rows[torch.arange(batch) % rows.shape[0]]


def time_call(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--logits", choices=["smollm2", "zipf", "normal"], default="smollm2",
                    help="smollm2: the real model's next-token logits at the positions of a few texts (transformers "
                         "on its GGUF); zipf: p ~ 1 / rank^1.1, shuffled; normal: N(0, 1), flat")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    rows = [Row([rng.randrange(args.vocab) for _ in range(args.prompt_len)],
                [rng.randrange(args.vocab) for _ in range(args.output_len)]) for _ in range(args.batch)]
    if args.logits == "smollm2":
        logits = smollm2_logits(args.batch)
        args.vocab = logits.shape[-1]
    elif args.logits == "zipf":  # most of the mass on few tokens, as a trained model's next-token distribution
        ranks = torch.arange(1, args.vocab + 1, dtype=torch.float32)
        logits = torch.stack([(-1.1 * ranks.log())[torch.randperm(args.vocab, generator=torch.Generator().manual_seed(i))]
                              for i in range(args.batch)])
    else:
        logits = torch.randn(args.batch, args.vocab)
    results = {}
    for greedy in (True, False):
        for name, kw in configs(rng, args.vocab).items():
            params = [SamplingParams(temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.95,
                                     **{"max_tokens": 16, **kw}) for _ in rows]
            gens = [None if greedy else torch.Generator().manual_seed(i) for i in range(len(rows))]
            def step():  # a decode step: each row one token longer, as the engine's sequences grow
                for r in rows:
                    r.token_ids.append(rng.randrange(args.vocab))
                return sample(logits, params, gens, rows, {0})
            ms = 1e3 * time_call(step, args.repeats)
            results[f"{'greedy' if greedy else 'sampled'} / {name}"] = ms
    out = {"batch": args.batch, "vocab": args.vocab, "logits": args.logits, "prompt_len": args.prompt_len, "output_len": args.output_len,
           "threads": args.threads, "cpu": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "ms_per_call": results,
           "added_ms_per_row": {k: (v - results[k.split(" / ")[0] + " / none"]) / args.batch
                                for k, v in results.items()}}
    for k, v in results.items():
        print(f"{k:48s} {v:8.2f} ms  (+{out['added_ms_per_row'][k] * 1e3:7.1f} us/row)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
