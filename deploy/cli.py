"""The `folio` command: builds the parser from each subcommand's module and dispatches to it.

    make-tiny-model, generate, serve, drain   deploy/commands/<name>.py
    bench (and `bench compare A B`)           deploy/bench/command.py

Each module has `add_parser(sub)` and `main(args) -> int` and imports what it runs
(torch, Ray, the cluster) only inside `main`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {  # subcommand -> its module, in the order `folio --help` lists them
    "make-tiny-model": "folio.deploy.commands.make_tiny_model",
    "generate": "folio.deploy.commands.generate",
    "serve": "folio.deploy.commands.serve",
    "drain": "folio.deploy.commands.drain",
    "bench": "folio.deploy.bench.command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio: PagedAttention LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        from folio.deploy.bench.command import compare_main

        return compare_main(argv[2:])
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return importlib.import_module(COMMANDS[args.command]).main(args)


if __name__ == "__main__":
    sys.exit(main())
