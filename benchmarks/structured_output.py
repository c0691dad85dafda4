"""Structured output on the real chat model: random JSON schemas, every output validated.

    .venv/bin/python benchmarks/structured_output.py [--model FILE.gguf] [--requests 200] [--out F]

Makes --requests random schemas (nested objects, enums, arrays, required fields, integers,
booleans, strings; seeded; numbers and strings bounded: a 135M model in a grammar that lets it
write digits for ever can do so until max_tokens, as one unbounded integer array did), asks SmolLM2-135M-Instruct (its GGUF; chat template) for a
JSON object matching each (the schema in the prompt, and `guided=GuidedSpec("json_schema")`,
what response_format json_schema becomes), all at once through the offline engine, and
validates every output with `jsonschema`. Then the mask's cost per decode step at batch 64:
filling 64 sequences' bitmasks (xgrammar's, then worker/utf8_mask.py's) and applying them to
[64, vocab] logits, medians of 30 steps, mid-object. Writes benchmarks/results/structured_output.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jsonschema  # noqa: E402
import torch  # noqa: E402

from folio.worker import LLM, SamplingParams  # noqa: E402
from folio.worker.guided import GuidedSpec, apply_bitmask  # noqa: E402

WORDS = ["name", "city", "age", "score", "color", "tags", "active", "level", "items", "owner", "kind", "count"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    props = {}
    for key in rng.sample(WORDS, rng.randint(1, 4)):
        r = rng.random()
        if r < 0.2 and depth < 2:
            props[key] = random_schema(rng, depth + 1)
        elif r < 0.35:
            props[key] = {"type": "array", "items": rng.choice([{"type": "integer", "minimum": 0, "maximum": 99},
                                                               {"type": "string", "maxLength": 12},
                                                               {"enum": ["low", "mid", "high"]}]),
                          "maxItems": rng.randint(1, 4)}
        elif r < 0.5:
            props[key] = {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "yes", "no"], rng.randint(2, 4))}
        elif r < 0.65:
            props[key] = {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 100, 1000])}
        elif r < 0.75:
            props[key] = {"type": "boolean"}
        else:
            props[key] = {"type": "string", "maxLength": rng.choice([8, 16, 32])}
    required = rng.sample(sorted(props), rng.randint(1, len(props)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "structured_output.json"))
    args = ap.parse_args()
    if args.model is None:
        from serve_smollm2 import smollm2_gguf
        args.model = smollm2_gguf()
    llm = LLM(args.model, block_size=16, num_kv_blocks=4096, max_num_seqs=64)
    tok = llm.tokenizer
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(args.requests)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Reply with a JSON object that matches this "
                                         f"JSON schema: {json.dumps(s)}"}], tokenize=False, add_generation_prompt=True)
               for s in schemas]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i,
                             guided=GuidedSpec("json_schema", json.dumps(s))) for i, s in enumerate(schemas)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    valid, reasons, failures = 0, {}, []
    for s, o in zip(schemas, outs):
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
        try:
            jsonschema.validate(json.loads(o.text), s)
            valid += 1
        except Exception as e:  # noqa: BLE001 - recorded
            failures.append({"schema": s, "text": o.text, "finish_reason": o.finish_reason, "error": str(e)[:200]})
    tokens = sum(len(o.token_ids) for o in outs)
    # the mask's cost at batch 64: 64 sequences mid-object (after '{"'), fill + apply, per step
    grammars = llm.engine.guided_grammars()
    seqs = []
    for s in schemas[:64]:  # a sequence as bitmask reads one: its matcher, its tokens (no output yet)
        m = grammars._xgr.GrammarMatcher(grammars.compiled(GuidedSpec("json_schema", json.dumps(s))))
        m.accept_string('{"')
        seqs.append(SimpleNamespace(grammar=m, token_ids=[], num_prompt_tokens=0))
    logits = torch.randn(len(seqs), llm.engine.vocab_size)
    fill, apply = [], []
    for _ in range(30):
        t = time.perf_counter()
        bm = grammars.bitmask(seqs)
        fill.append(time.perf_counter() - t)
        x = logits.clone()
        t = time.perf_counter()
        apply_bitmask(x, list(range(len(seqs))), bm)
        apply.append(time.perf_counter() - t)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": os.path.basename(args.model), "backend": "xgrammar 0.2.9",
           "requests": args.requests, "valid": valid, "valid_share": valid / args.requests, "finish_reasons": reasons,
           "output_tokens": tokens, "generate_s": round(gen_s, 1), "out_tok_per_s": round(tokens / gen_s, 1),
           "mask_batch": len(seqs), "mask_fill_ms_median": 1e3 * statistics.median(fill),
           "mask_apply_ms_median": 1e3 * statistics.median(apply), "failures": failures[:20],
           "examples": [{"schema": s, "text": o.text} for s, o in list(zip(schemas, outs))[:5]]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{valid}/{args.requests} valid ({reasons}); {tokens} tokens in {gen_s:.0f} s; mask at batch "
          f"{len(seqs)}: fill {doc['mask_fill_ms_median']:.2f} ms + apply {doc['mask_apply_ms_median']:.2f} ms "
          f"per step; wrote {args.out}")
    return 0 if valid == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
