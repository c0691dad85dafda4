"""`folio bench`: load-test a Folio (or any OpenAI-compatible) server.

    folio bench --target http://localhost:8000 --workload random --num-requests 200 \\
        --rate 4 [--arrival gamma --burstiness 0.5] [--max-concurrency 32] [--duration 60] \\
        [--sweep 1,2,4,8] [--slo ttft=0.5,tpot=0.05] [--out result.json] [--plots DIR]
    folio bench compare A.json B.json

Workloads: deploy/bench/workloads.py; the client loop: deploy/bench/client.py; the
report: deploy/bench/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from folio.deploy.bench import report
from folio.deploy.bench.client import LoadShape, make_target, run_load
from folio.deploy.bench.workloads import WORKLOADS, build, parse_id_range


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load-test a server (or: folio bench compare A.json B.json)")
    p.add_argument("--target", required=True, help="http://host:port (OpenAI API) or grpc://host:port (Folio)")
    p.add_argument("--model", default=None, help="model name for the OpenAI API (default: the first listed)")
    p.add_argument("--api-key", default=os.environ.get("FOLIO_API_KEY"))
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="http targets: /v1/completions, or /v1/chat/completions with each prompt as a user message")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--input-len", default="uniform:32-256",
                   help="in --input-unit: fixed:N | uniform:A-B | lognormal:MED,SIGMA")
    p.add_argument("--input-unit", choices=["words", "tokens"], default="words",
                   help="tokens: prompts are token ids of exactly that length (random, burst, shared-prefix)")
    p.add_argument("--token-id-range", default="1000-8000", help="--input-unit tokens: ids drawn from LO-HI")
    p.add_argument("--output-len", default="uniform:32-128", help="max_tokens, same forms")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix: number of prefixes")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: words per prefix")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    p.add_argument("--dataset", default=None, help="sharegpt: the JSON file")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: all at once)")
    p.add_argument("--sweep", default=None, help="comma-separated rates, one run each")
    p.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: < 1 burstier than Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds after which no new request starts")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="ask for this many tokens per streamed chunk (vLLM's and Folio's stream_interval; "
                        "over gRPC GenerateRequest.stream_interval; the server's own --stream-interval is the floor)")
    p.add_argument("--slo", default=None, help="goodput SLOs in seconds: ttft=0.5,tpot=0.05,e2e=10")
    p.add_argument("--metrics-url", default=None, help="Folio /metrics (default: TARGET/metrics for http)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="name of this run in compare tables")
    p.add_argument("--out", default=None, help="JSON result file")
    p.add_argument("--plots", default=None, help="directory for the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


async def _run(args) -> dict:
    slo = report.parse_slo(args.slo)
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.rate]
    metrics_url = args.metrics_url or (args.target.rstrip("/") + "/metrics" if args.target.startswith("http")
                                       else None)
    target = make_target(args.target, args.model, args.api_key, ignore_eos=not args.no_ignore_eos,
                         endpoint=args.endpoint, stream_interval=args.stream_interval)
    if args.endpoint == "chat" and args.input_unit == "tokens":
        raise ValueError("--endpoint chat sends text: --input-unit tokens needs the completions endpoint")
    runs = []
    try:
        await target.resolve_model()
        for rate in rates:
            workload = build(args.workload, args.num_requests, args.seed, args.input_len, args.output_len,
                             args.prefixes, args.prefix_len, args.turns, args.dataset, args.input_unit,
                             parse_id_range(args.token_id_range))
            shape = LoadShape(rate or None, args.arrival, args.burstiness, args.max_concurrency, args.duration,
                              args.request_timeout)
            poller = report.MetricsPoller(metrics_url, api_key=args.api_key)
            await poller.start()
            cpu0 = time.process_time()  # this client's own CPU over the run (all its threads), start-up left out
            records, wall = await run_load(target, workload, shape, args.seed, progress=not args.quiet)
            cpu = time.process_time() - cpu0
            folio = await poller.stop()
            summary = report.summarize(records, wall, slo)
            summary["client_cpu_s"] = cpu  # on one machine, CPU the load tool took from the server
            summary["client_cpu_s_per_1k_output_tokens"] = 1e3 * cpu / summary["output_tokens"] if summary[
                "output_tokens"] else None
            summary["folio"] = folio
            run = {"rate": rate, "summary": summary, "timeline": poller.timeline,
                   "records": [vars(r) | {"text": None} for r in records]}
            if args.plots:
                os.makedirs(args.plots, exist_ok=True)
                run["plots"] = report.plot(records, poller.timeline,
                                           os.path.join(args.plots, f"{args.workload}_rate{rate or 'inf'}"))
            print(f"\n== {args.workload} at {rate or 'all at once'} req/s against {args.target} ==")
            print(report.table(summary))
            runs.append(run)
    finally:
        await target.close()
    return {"benchmark": "folio bench", "label": args.label or args.target, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "target": args.target, "model": target.model, "workload": args.workload, "endpoint": args.endpoint,
            "command": " ".join(["folio"] + sys.argv[1:]), "runs": runs}


def _loop_factory():
    """uvloop's event loop where installed (as uvicorn and Ray's actors use it), unless
    FOLIO_BENCH_UVLOOP=0: a load client on the server's machine takes CPU from the server, and
    asyncio's own loop spends more of it per streamed chunk."""
    if os.environ.get("FOLIO_BENCH_UVLOOP", "1") != "0":
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            pass
    return None


def main(args) -> int:
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            doc = runner.run(_run(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        report.write_json(args.out, doc)
        print(f"results: {args.out}")
    return 0


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="folio bench compare")
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args(argv)
    import json

    with open(args.a) as fa, open(args.b) as fb:
        print(report.compare(json.load(fa), json.load(fb)))
    return 0
