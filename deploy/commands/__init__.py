"""The `folio` command's subcommands, one module each: `add_parser(sub)` adds the
subcommand's options to deploy/cli.py's parser, `main(args) -> int` runs it.

    make_tiny_model.py  `folio make-tiny-model DIR`: a tiny random checkpoint + tokenizer
    generate.py         `folio generate --model M PROMPT...`: offline generation in this process
    serve.py            `folio serve`: a cluster (Ray workers, router, coordinator, Redis) and its frontends
    drain.py            `folio drain`: a running cluster's workers stop admitting (a preStop hook)

`folio bench` is the load-test harness's own package (deploy/bench/command.py). The engine's
flags of `serve` and `generate` come from EngineConfig's fields (deploy/engine_flags.py).
"""
