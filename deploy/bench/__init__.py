"""`folio bench`: the load-test harness for a Folio (or any OpenAI-compatible) server.

    command.py    the `folio bench` and `folio bench compare` commands (parser, runs, sweeps)
    workloads.py  what to send: random, shared-prefix, multi-turn, burst, sharegpt
    client.py     the client loop: targets (HTTP, gRPC), load shapes, one Record per request
    report.py     metrics as `vllm bench serve` reports them, Folio's /metrics, tables, plots, compare
"""
