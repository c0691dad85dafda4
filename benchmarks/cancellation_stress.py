"""Cancellation stress through `folio serve`: clients that leave mid-stream leave nothing behind.

    python benchmarks/cancellation_stress.py --model DIR [--runs 20] [--rounds 5] [--clients 200]

DIR as recorded: `folio make-tiny-model DIR` (the defaults: 2 layers, hidden 64, vocab 1024);
a fast model is the harder case (more tokens per second run between a client leaving and its abort).

One `folio serve` (2 workers, embedded Redis, HTTP + gRPC); each round starts `--clients`
streaming requests at once (max_tokens 1000, ignore_eos), which all leave early:
half over HTTP (aiohttp; the connection is closed after 0-5 SSE chunks, or at 0 half the
time before the response headers came), a quarter over gRPC cancelled after 0-5 messages,
a quarter over gRPC with a deadline: half of them 0.05-0.6 s (it expires before the first
message: the burst's prefills take longer), half 0.6-1.3 x the last round's median time to a
first message (1 s before the first round; it expires around it, often mid-stream; a later one reads hundreds
of tokens); none past half the time one lone whole request takes (timed before the first round: on a fast
CPU the tiny model ran a whole request inside a 1.3 s deadline, CI 2026-12-06). After each round the
workers must go idle (nothing running, waiting or swapped, every KV block free: their
heartbeats in Redis) within `--idle-timeout-s`, and the generation counter (the workers'
own, from the heartbeats) must have moved past what the clients read by < 5 % of the possible
tokens (clients x max_tokens): a request whose abort was lost runs on to its 1,000 tokens.
(Until 2026-12-02 the counter's whole move was held to 5 %; on a faster CPU with the TCP data
plane the clients themselves read 6.2 % in a round of 60, their deadline clients reading
hundreds of tokens each, while the workers made only 1.2 % past it.) Worker RSS
(psutil, the EngineWorker processes under the serve process) is read after each round.

A miss: a round over 5 % past what was read, workers not idle (or KV not free) by the deadline, or a client
error (a refused or failed request makes the round say nothing). Results per round, per run
and overall in benchmarks/results/cancellation_stress.json; one summary line per run.
tests/e2e/test_cancellation_serve.py runs one round of this against its own server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 1000
DEADLINE_CAP = 0.5  # a deadline client's deadline is at most this share of a lone whole request's time
MISS_SHARE = 0.05  # of the possible tokens, made past what the clients read
RSS_FLAT_MB = 20.0  # worker RSS growth after the first run that still counts as flat


# ---- the server --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_url_of(ready_line: str) -> str:
    """As tests/conftest.py: an embedded Redis's URL (with its password) is in the file the line names."""
    m = re.search(r"redis (redis://\S+)(?: \(embedded; URL with its password in (\S+)\))?", ready_line)
    if m.group(2) is None:
        return m.group(1)
    with open(m.group(2)) as f:
        return f.read().strip()


def start_server(model: str, namespace: str, workers: int = 2, kv_blocks: int = 2048, max_model_len: int = 2048,
                 ready_timeout_s: float = 300.0) -> dict:
    http, grpc_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", prefix="folio-cancel-", delete=False)
    cmd = [sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model, "--num-workers", str(workers),
           "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc_port), "--block-size", "16",
           "--num-kv-blocks", str(kv_blocks), "--max-model-len", str(max_model_len), "--max-num-requests", "4096",
           "--router", "least-loaded", "--namespace", namespace, "--grace-period-s", "2", "--served-model-name", "m"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_raylet_start_wait_time_s="180")  # a loaded machine: Ray's 60 s default timed out once
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)  # a file: no pipe to fill up
    srv = {"proc": proc, "log": log.name, "http": f"http://127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc_port}",
           "namespace": namespace, "workers": workers}
    deadline = time.monotonic() + ready_timeout_s
    while True:
        ready = [ln for ln in open(log.name, errors="replace") if "folio serve: ready" in ln]
        if ready:
            srv["redis"] = redis_url_of(ready[0])
            return srv
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(srv)
            raise RuntimeError(f"folio serve did not come up; log: {log.name}")
        time.sleep(0.5)


def stop_server(srv: dict) -> int | None:
    proc = srv["proc"]
    if srv.get("loop") is not None:
        srv["loop"].close()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode == 0:  # a clean stop: its log has nothing to tell (kept otherwise, for the failure)
        with contextlib.suppress(OSError):
            os.unlink(srv["log"])
    return proc.returncode


def worker_pids(srv: dict) -> dict[str, int]:
    import psutil

    out = {}
    for p in psutil.Process(srv["proc"].pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "EngineWorker" in cmd or "FolioFrontend" in cmd:
            kind = "worker" if "EngineWorker" in cmd else "frontend"
            out[f"{kind}-{p.pid}"] = p.pid
    return out


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = None
    return out


# ---- idle, from the workers' heartbeats ------------------------------------------------------
def _idle(load) -> bool:
    return (load.num_running + load.num_waiting + load.num_swapped == 0 and load.num_free_blocks == load.num_kv_blocks
            and load.num_free_cpu_blocks == load.num_cpu_blocks)


def wait_idle(state, workers: int, timeout_s: float, settle_s: float = 0.5) -> tuple[bool, dict, float]:
    """(idle, loads, seconds): every worker idle in heartbeats made after this call, with the
    generation counter unchanged over `settle_s` (a submit still on its way would show)."""
    t0, since = time.monotonic(), time.time()
    calm = None  # (wall time, generated) of the first idle view of a calm stretch
    loads: dict = {}
    while True:
        try:
            loads = state.live_loads()
        except Exception:  # Redis busy for a moment: ask again
            loads = {}
        ok = len(loads) == workers and all(l.timestamp > since and _idle(l) for l in loads.values())
        if ok:
            gen = generated(loads)
            if calm is None or calm[1] != gen:
                calm = (time.time(), gen)
            elif all(l.timestamp > calm[0] + settle_s for l in loads.values()):
                return True, loads, time.monotonic() - t0
        else:
            calm = None
        if time.monotonic() - t0 > timeout_s:
            return False, loads, time.monotonic() - t0
        time.sleep(0.05)


def generated(loads: dict) -> int:
    return int(sum(l.counters.generation_tokens for l in loads.values()))


def load_view(loads: dict) -> dict:
    return {w: {"running": l.num_running, "waiting": l.num_waiting, "swapped": l.num_swapped,
                "kv_usage": round(l.kv_usage, 4), "free_blocks": l.num_free_blocks, "blocks": l.num_kv_blocks}
            for w, l in sorted(loads.items())}


# ---- the clients ----------------------------------------------------------------------------
def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))]


async def http_client(session, url: str, rng: random.Random, leave_after: int, max_tokens: int) -> int:
    """Stream a completion and close the connection after `leave_after` SSE chunks (at 0,
    half the time before the response headers). Returns the tokens it read."""
    body = {"model": "m", "prompt": _prompt(rng), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if leave_after == 0 and rng.random() < 0.5:
        task = asyncio.ensure_future(session.post(url, json=body))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()  # gone before the headers came: aiohttp drops the connection
        try:
            r = await task
            r.close()
        except asyncio.CancelledError:
            pass
        return 0
    read = n = 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        while n < leave_after:
            line = await r.content.readline()
            if not line:
                raise RuntimeError("the stream ended")
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk or any(c.get("finish_reason") for c in chunk["choices"]):
                raise RuntimeError(f"the stream ended: {chunk}")
            read, n = chunk["usage"]["completion_tokens"], n + 1
        r.close()  # the client goes away: the socket is closed mid-stream
    return read


def _grpc_request(rng: random.Random, max_tokens: int):
    from folio.v1 import generate_pb2 as pb

    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=_prompt(rng)), sampling=pb.SamplingParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def grpc_cancel_client(stub, rng: random.Random, leave_after: int, max_tokens: int) -> tuple[int, float | None]:
    """Cancel the stream after `leave_after` messages (at 0, as soon as it is started).
    Returns (tokens read, seconds to the first message or None)."""
    t0 = time.monotonic()
    call = stub.GenerateStream(_grpc_request(rng, max_tokens))
    read = n = 0
    ttft = None
    if leave_after:
        async for msg in call:
            if msg.finished:
                raise RuntimeError(f"the stream ended: {msg}")
            ttft = time.monotonic() - t0 if ttft is None else ttft
            read, n = read + sum(len(d.token_ids) for d in msg.deltas), n + 1
            if n >= leave_after:
                break
    else:
        await asyncio.sleep(rng.uniform(0, 0.05))
    call.cancel()
    return read, ttft


async def grpc_deadline_client(stub, rng: random.Random, max_tokens: int, ttft_s: float | None,
                               whole_s: float) -> tuple[int, int]:
    """Read until the call's deadline expires: 0.05-0.6 s (`ttft_s` None: under the burst,
    before the first message), or 0.6-1.3 x `ttft_s` (the last round's median time to a
    first message: around it, mid-stream); never past DEADLINE_CAP x `whole_s`, the time one
    whole request takes alone, so that the deadline, not the request's end, stops it.
    Returns (tokens read, messages read)."""
    import grpc

    timeout = rng.uniform(0.05, 0.6) if ttft_s is None else rng.uniform(0.6, 1.3) * ttft_s
    timeout = min(timeout, DEADLINE_CAP * whole_s)
    call = stub.GenerateStream(_grpc_request(rng, max_tokens), timeout=timeout)
    read = n = 0
    try:
        async for msg in call:
            if msg.finished:
                raise RuntimeError(f"the stream ended: {msg}")
            read, n = read + sum(len(d.token_ids) for d in msg.deltas), n + 1
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    return read, n


async def whole_request_s(srv: dict, max_tokens: int, tries: int = 3) -> float:
    """The fastest of `tries` lone requests of `max_tokens`, start to finish, over gRPC."""
    import grpc

    from folio.v1 import generate_pb2_grpc as pb_grpc

    best = float("inf")
    async with grpc.aio.insecure_channel(srv["grpc"]) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for i in range(tries):
            t0 = time.monotonic()
            async for msg in stub.GenerateStream(_grpc_request(random.Random(i), max_tokens)):
                if msg.finished:
                    break
            best = min(best, time.monotonic() - t0)
    return best


async def drive(srv: dict, clients: int, seed: int, max_tokens: int, ttft_s: float, whole_s: float) -> dict:
    """One round: `clients` clients at once (half HTTP, a quarter gRPC cancel, a quarter deadline)."""
    import aiohttp
    import grpc

    from folio.v1 import generate_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    kinds = ["http" if i % 2 == 0 else "grpc_cancel" if i % 4 == 1 else "grpc_deadline" for i in range(clients)]
    out = {k: {"clients": 0, "read": 0, "errors": 0} for k in set(kinds)}
    if "grpc_deadline" in out:
        out["grpc_deadline"]["messages_before_deadline"] = [0] * 8  # [7]: 7 or more
    errors: list[str] = []
    ttfts: list[float] = []
    url = srv["http"] + "/v1/completions"

    async def one(i: int, kind: str, session, stub):
        r = random.Random(rng.random())
        try:
            if kind == "http":
                got = await http_client(session, url, r, r.randint(0, 5), max_tokens)
            elif kind == "grpc_cancel":
                got, ttft = await grpc_cancel_client(stub, r, r.randint(0, 5), max_tokens)
                ttfts.extend([ttft] if ttft is not None else [])
            else:
                got, n = await grpc_deadline_client(stub, r, max_tokens, ttft_s if i % 8 == 7 else None, whole_s)
                out[kind]["messages_before_deadline"][min(n, 7)] += 1
            out[kind]["read"] += got
        except Exception as e:
            out[kind]["errors"] += 1
            errors.append(f"{kind}: {type(e).__name__}: {str(e)[:200]}")
        out[kind]["clients"] += 1

    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with grpc.aio.insecure_channel(srv["grpc"]) as ch:
            stub = pb_grpc.GenerationStub(ch)
            await asyncio.gather(*(one(i, k, session, stub) for i, k in enumerate(kinds)))
    out["errors"] = errors[:10]
    out["num_errors"] = len(errors)
    out["deadline_base_s"] = round(ttft_s, 3)
    out["deadline_cap_s"] = round(DEADLINE_CAP * whole_s, 3)
    out["ttft_median_s"] = round(sorted(ttfts)[len(ttfts) // 2], 3) if ttfts else None
    return out


# ---- rounds and runs --------------------------------------------------------------------------
def one_round(srv: dict, state, pids: dict, clients: int, seed: int, max_tokens: int = MAX_TOKENS,
              idle_timeout_s: float = 120.0) -> dict:
    if srv.get("loop") is None:  # one event loop for all rounds (grpc.aio's poller outlives a closed one)
        srv["loop"] = asyncio.new_event_loop()
    if srv.get("whole_s", {}).get(max_tokens) is None:
        srv.setdefault("whole_s", {})[max_tokens] = srv["loop"].run_until_complete(whole_request_s(srv, max_tokens))
    ok, loads, _ = wait_idle(state, srv["workers"], idle_timeout_s)
    before = generated(loads)
    t0 = time.monotonic()
    res = srv["loop"].run_until_complete(drive(srv, clients, seed, max_tokens, srv.get("ttft_s", 1.0),
                                               srv["whole_s"][max_tokens]))
    srv["ttft_s"] = res["ttft_median_s"] or srv.get("ttft_s", 1.0)
    clients_s = time.monotonic() - t0
    idle, loads, idle_s = wait_idle(state, srv["workers"], idle_timeout_s)
    made, possible = generated(loads) - before, clients * max_tokens
    read = sum(v["read"] for v in res.values() if isinstance(v, dict))
    misses = []
    if not ok:
        misses.append("not idle before the round")
    if made - read >= MISS_SHARE * possible:
        misses.append(f"generated {made}, read {read}: {made - read} >= {MISS_SHARE:.0%} of {possible}")
    if not idle:
        misses.append(f"not idle {idle_timeout_s:.0f} s after the clients left: {load_view(loads)}")
    if res["num_errors"]:
        misses.append(f"{res['num_errors']} client errors")
    return {"seed": seed, "clients": clients, "possible_tokens": possible, "generated_tokens": made,
            "generated_share": round(made / possible, 5), "read_tokens": read, "generated_minus_read": made - read,
            "clients_s": round(clients_s, 2), "idle_after_s": round(idle_s, 2), "idle": idle,
            "loads_after": load_view(loads), "rss_mb_after": rss_mb(pids), "by_kind": res, "misses": misses}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--idle-timeout-s", type=float, default=120.0)
    ap.add_argument("--max-minutes", type=float, default=None, help="start no run after this (reported)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cancellation_stress.json"))
    args = ap.parse_args()
    from folio.cluster.state import ClusterState

    t_start = time.time()
    srv = start_server(os.path.abspath(args.model), f"cstress{os.getpid()}")
    runs, stopped_early = [], False
    try:
        state = ClusterState(srv["redis"], srv["namespace"])
        wait_idle(state, srv["workers"], 120.0)
        pids = worker_pids(srv)
        rss0 = rss_mb(pids)
        for run in range(args.runs):
            if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
                stopped_early = True
                break
            t0, rss_before = time.monotonic(), rss_mb(pids)
            rounds = [one_round(srv, state, pids, args.clients, 1000 * run + r, args.max_tokens, args.idle_timeout_s)
                      for r in range(args.rounds)]
            rss_after = rounds[-1]["rss_mb_after"]
            misses = sum(1 for r in rounds if r["misses"])
            hist = [sum(r["by_kind"]["grpc_deadline"]["messages_before_deadline"][i] for r in rounds) for i in range(8)]
            runs.append({"run": run, "seconds": round(time.monotonic() - t0, 1), "misses": misses,
                         "max_generated_share": max(r["generated_share"] for r in rounds),
                         "rss_mb_before": rss_before, "rss_mb_after": rss_after, "rounds": rounds})
            print(f"run {run + 1}/{args.runs}: {misses} misses in {args.rounds} rounds of {args.clients}; generated "
                  f"{[r['generated_tokens'] for r in rounds]} of {rounds[0]['possible_tokens']} possible "
                  f"(max {runs[-1]['max_generated_share']:.2%}), read {[r['read_tokens'] for r in rounds]}; "
                  f"idle after {max(r['idle_after_s'] for r in rounds):.1f} s max; KV "
                  f"{'free' if all(r['idle'] for r in rounds) else 'NOT FREE'}; rss {rss_before} -> {rss_after}; "
                  f"{runs[-1]['seconds']} s; deadline calls by messages read before it [0..7+]: "
                  f"{hist}",
                  flush=True)
            for r in rounds:
                for m in r["misses"]:
                    print(f"  MISS round seed {r['seed']}: {m}", flush=True)
    finally:
        rc = stop_server(srv)
    workers = [k for k in rss0 if k.startswith("worker")]
    base = runs[0]["rss_mb_after"] if runs else rss0
    last = runs[-1]["rss_mb_after"] if runs else rss0
    growth = {k: round((last.get(k) or 0) - (base.get(k) or 0), 1) for k in rss0}
    rss_flat = all(growth[k] < RSS_FLAT_MB for k in workers)
    doc = {"benchmark": "cancellation_stress", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "model": args.model, "workers": srv["workers"],
           "runs_asked": args.runs, "runs_done": len(runs), "stopped_early": stopped_early, "rounds": args.rounds,
           "clients": args.clients, "max_tokens": args.max_tokens, "miss_share": MISS_SHARE,
           "wall_s": round(time.time() - t_start, 1), "server_exit_code": rc,
           "runs_with_a_miss": sum(1 for r in runs if r["misses"]), "rounds_missed": sum(r["misses"] for r in runs),
           "max_generated_share": max((r["max_generated_share"] for r in runs), default=None),
           "rss_mb_at_start": rss0, "rss_growth_after_first_run_mb": growth, "rss_flat": rss_flat,
           "rss_flat_mb": RSS_FLAT_MB, "runs": runs}
    print(f"overall: {doc['runs_done']} runs, {doc['runs_with_a_miss']} with a miss, {doc['rounds_missed']} rounds "
          f"missed; max generated {doc['max_generated_share']:.2%} of possible; worker RSS growth after run 1 "
          f"{growth} ({'flat' if rss_flat else 'NOT FLAT'}); {doc['wall_s']} s", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if not doc["runs_with_a_miss"] and rss_flat and not stopped_early else 1


if __name__ == "__main__":
    sys.exit(main())
