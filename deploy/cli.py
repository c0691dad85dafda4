"""The `folio` command."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _add_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write a tiny random Llama-family checkpoint + tokenizer")
    p.add_argument("dir")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--init-std", type=float, default=0.08)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate offline from a local checkpoint")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory or a GGUF file")
    p.add_argument("--tokenizer", default=None, help="the tokenizer's directory (default: the model's own)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-manager", choices=["paged", "contiguous"], default="paged")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio: PagedAttention LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny(sub)
    _add_generate(sub)
    from folio.deploy.serve import add_drain_parser, add_serve_parser

    add_serve_parser(sub)
    add_drain_parser(sub)
    from folio.deploy.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        from folio.deploy.bench import compare_main

        return compare_main(argv[2:])
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "make-tiny-model":
        from folio.deploy.tiny_model import TinySpec, make_tiny_model

        spec = TinySpec(arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
                        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                        intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                        max_position_embeddings=args.max_position_embeddings, seed=args.seed,
                        init_std=args.init_std)
        make_tiny_model(args.dir, spec)
        print(f"wrote a tiny {args.arch} checkpoint to {args.dir}")
        return 0
    if args.command == "generate":
        from folio.worker import LLM, FolioError, SamplingParams

        try:
            llm = LLM(args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                      dtype=args.dtype, kv_manager=args.kv_manager, tokenizer=args.tokenizer)
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
    if args.command == "bench":
        from folio.deploy.bench import bench_main

        return bench_main(args)
    if args.command == "drain":
        from folio.deploy.serve import drain_main

        return drain_main(args)
    if args.command == "serve":
        from folio.deploy.serve import serve

        return serve(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
