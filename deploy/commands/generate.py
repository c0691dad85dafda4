"""`folio generate --model M PROMPT...`: generate offline, in this process, from a local
checkpoint (no Ray, no server). The engine's flags are EngineConfig's (deploy/engine_flags.py)
but `--seed`, which here seeds the sampling of these prompts."""

from __future__ import annotations

import argparse
import json
import sys

from folio.deploy.engine_flags import add_engine_flags, engine_kwargs

NOT_ENGINE_FLAGS = ("seed",)  # --seed is the sampling's (SamplingParams.seed)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate offline from a local checkpoint")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(p, exclude=NOT_ENGINE_FLAGS)
    return p


def main(args) -> int:
    from folio.worker import LLM, FolioError, SamplingParams

    try:
        llm = LLM(args.model, **engine_kwargs(args, exclude=NOT_ENGINE_FLAGS))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, n=args.n,
                                ignore_eos=args.ignore_eos)
        outs = llm.generate(args.prompts, params)
    except FolioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(f"{out.prompt!r} -> {c.text!r} [{c.finish_reason}]")
    return 0
