"""What the serving path adds to a request: `folio serve` (one worker) against the engine
alone, one request at a time, 16-token prompt, 1 output token (so the time is almost all
path, not model).

    python benchmarks/frontend_overhead.py --model models/tiny-llama-8l [--requests 50] [--vllm]

Engine alone: LLMEngine.add_request + step() in this process. Through the server: the
HTTP API (non-streaming /v1/completions with the `openai` client) and gRPC (Generate),
each served by the frontend replica itself (its router, then the worker's TCP channel:
worker/data_plane.py). The HTTP request is also timed with a minimal client (`RawHttp`: one
keep-alive HTTP/1.1 connection, the same JSON body, the response read and parsed), since the
`openai` client's own CPU (~2 ms a request here, httpx and pydantic) is part of what it times
and is not the server's. Targets (issue #15): the path adds < 2 ms p50 over gRPC, < 4 ms over
HTTP. With --vllm, the same for vLLM as the reference of what this machine allows: its offline
`LLM` (one `generate` call per request, in .venv-vllm) against `vllm serve` over HTTP (the same
`openai` client call), both float32 with prefix caching on, as `folio serve` has it.
Results: benchmarks/results/frontend_overhead.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q / 100 * len(xs)), len(xs) - 1)]


def served_timings(http_port: int) -> dict[str, float]:
    """The served worker's cumulative step seconds by phase, and its step count, from /metrics
    (published with its load figures: waits for a heartbeat after the last request)."""
    import urllib.request

    time.sleep(0.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("folio_engine_step_seconds_total{"):
            key, value = line.rsplit(" ", 1)
            out[key.split('phase="')[1].split('"')[0]] = float(value)
        elif line.startswith("folio_engine_steps_total{"):
            out["steps"] = float(line.rsplit(" ", 1)[1])
    return out


def step_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per step of each phase between two cumulative readings (and the steps counted)."""
    n = after["steps"] - before["steps"]
    doc = {k: round(1e3 * (after[k] - before[k]) / max(n, 1), 3) for k in after if k != "steps"}
    doc["total"] = round(sum(doc.values()), 3)
    doc["steps"] = int(n)
    return doc


def start_one_worker(model: str, namespace: str):
    """`folio serve` with one worker of this benchmark's engine settings on free loopback ports,
    once ready: (process, http port, grpc port); its output is drained from then on
    (background_cost.py starts the same)."""
    import threading

    http, grpc_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model,
                               "--num-workers", "1", "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port",
                               str(grpc_port), "--block-size", "16", "--num-kv-blocks", "256", "--max-model-len",
                               "1024", "--router", "least-loaded", "--namespace", namespace, "--served-model-name", "m"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    for line in server.stdout:
        if "folio serve: ready" in line:
            break
    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
    return server, http, grpc_port


def vllm_offline(model: str, n: int) -> list[float]:
    """In .venv-vllm: ms per one-token request through vLLM's offline `LLM`, after 5 warm-ups."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=1024, seed=0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ms = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(100, 116))}], sp, use_tqdm=False)
        if i >= 5:
            ms.append(1e3 * (time.perf_counter() - t0))
    return ms


class RawHttp:
    """The least a client does for a completion: one keep-alive HTTP/1.1 connection, a JSON
    POST, the whole response read and its JSON parsed."""

    def __init__(self, port: int) -> None:
        import http.client

        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def complete(self, model: str, prompt: list[int]) -> dict:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "ignore_eos": True})
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)


def vllm_reference(model: str, n: int, stats) -> dict:
    """vLLM's offline `LLM` and `vllm serve` (HTTP), one one-token request at a time."""
    import tempfile

    import openai

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from long_prompt_neighbours import start_vllm

    py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-vllm", "bin", "python")
    res = os.path.join(tempfile.mkdtemp(prefix="folio-overhead-vllm-"), "offline.json")
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import frontend_overhead as f; json.dump(f.vllm_offline({os.path.abspath(model)!r}, {n}), "
            f"open({res!r}, 'w'))")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1")
    p = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if p.returncode != 0:
        raise SystemExit(f"vLLM's offline run failed:\n{p.stderr[-3000:]}")
    with open(res) as f:
        offline = json.load(f)
    srv, port = start_vllm(model, 2048, "--max-model-len", "1024", "--seed", "0")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        raw = RawHttp(port)
        name = os.path.basename(model.rstrip("/"))
        http_ms, raw_ms = [], []
        for i in range(n + 5):
            t0 = time.perf_counter()
            client.completions.create(model=name, prompt=list(range(100, 116)), max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True})
            t1 = time.perf_counter()
            raw.complete(name, list(range(100, 116)))
            if i >= 5:
                http_ms.append(1e3 * (t1 - t0))
                raw_ms.append(1e3 * (time.perf_counter() - t1))
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(60)
    return {"offline_ms": stats(offline), "http_ms": stats(http_ms), "http_raw_ms": stats(raw_ms),
            "added_p50_ms": {"http": round(pct(http_ms, 50) - pct(offline, 50), 2),
                             "http_raw": round(pct(raw_ms, 50) - pct(offline, 50), 2)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--vllm", action="store_true", help="also vLLM's offline LLM against vllm serve (.venv-vllm)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "frontend_overhead.json"))
    args = ap.parse_args()
    prompt = list(range(100, 116))

    from folio.worker import LLM, SamplingParams

    llm = LLM(args.model, block_size=16, num_kv_blocks=256, max_model_len=1024, enable_prefix_caching=False)
    eng = llm.engine
    engine_ms = []
    alone = None
    for i in range(args.requests + 5):
        t0 = time.perf_counter()
        eng.add_request(f"e{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        if i == 4:
            alone = dataclasses.replace(eng.timings)
        if i >= 5:
            engine_ms.append(1e3 * (time.perf_counter() - t0))
    alone_step = step_ms(vars(alone), vars(eng.timings))
    del llm, eng

    server, http, grpc_port = start_one_worker(args.model, "overhead")
    try:
        import grpc
        import openai

        from folio.v1 import generate_pb2 as pb
        from folio.v1 import generate_pb2_grpc as pbg

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0)
        stub = pbg.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        raw = RawHttp(http)
        http_ms, grpc_ms, raw_ms = [], [], []
        served_before = None
        for i in range(args.requests + 5):  # alternated, after 5 warm-ups each
            if i == 5:
                served_before = served_timings(http)
            t0 = time.perf_counter()
            client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True})
            t1 = time.perf_counter()
            req = pb.GenerateRequest(sampling=pb.SamplingParameters(max_tokens=1, temperature=0, ignore_eos=True))
            req.token_ids.ids.extend(prompt)
            stub.Generate(req)
            t2 = time.perf_counter()
            raw.complete("m", prompt)
            if i >= 5:
                http_ms.append(1e3 * (t1 - t0))
                grpc_ms.append(1e3 * (t2 - t1))
                raw_ms.append(1e3 * (time.perf_counter() - t2))
        served_step = step_ms(served_before, served_timings(http))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    def stats(xs):
        return {"p50": round(pct(xs, 50), 2), "p99": round(pct(xs, 99), 2), "mean": round(statistics.fmean(xs), 2)}
    e50 = pct(engine_ms, 50)
    doc = {"benchmark": "frontend_overhead", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv), "requests": args.requests,
           "engine_alone_ms": stats(engine_ms), "http_ms": stats(http_ms), "grpc_ms": stats(grpc_ms),
           "http_raw_ms": stats(raw_ms),
           "added_p50_ms": {"http": round(pct(http_ms, 50) - e50, 2), "grpc": round(pct(grpc_ms, 50) - e50, 2),
                            "http_raw": round(pct(raw_ms, 50) - e50, 2)},
           # one engine step per request (1 output token): the mean step by phase, in this process
           # and in the served worker (its /metrics), so the path's share and the engine's own
           # slowdown when served can be told apart
           "engine_alone_step_ms": alone_step, "served_engine_step_ms": served_step}
    if args.vllm:
        doc["vllm"] = vllm_reference(args.model, args.requests, stats)
    print(json.dumps(doc, indent=2))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
