"""What one long prompt does to the requests that arrive while it is prefilled, through
`folio serve` (issue #15: a server no single request can hold up).

    python benchmarks/long_prompt_neighbours.py --model models/SmolLM2-135M-Instruct.Q4_1-f32
        [--long-tokens 7700] [--variants "default,--long-prefill-token-threshold 0"] [--rounds 2] [--vllm]

One `folio serve` per variant (`default`: the server's own settings, a long prompt prefilled
in chunks of at most a quarter of its 2,048-token step budget; else extra
`folio serve` flags, e.g. `--long-prefill-token-threshold 0`: off, a long prompt's chunks take
the whole budget as in vLLM's default scheduler), all up at once and idle while another is
measured, run A B B A per round. A run: one completion with a `--long-tokens` prompt of random token ids
(max_tokens 1) and, while it runs, a short streamed completion (8 random tokens -> 4) every
`--interval` s from another client: the short ones' time to first token and to their end, and
the long one's time. `--vllm` adds `vllm serve` (from .venv-vllm, float32, the same step
budget) to the rotation. Results: benchmarks/results/long_prompt_neighbours.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import serve_local  # noqa: E402


def completion(port: int, model: str, prompt: list[int], max_tokens: int, timeout: float) -> tuple[float, float]:
    """One streamed completion: (seconds to its first token, seconds to its end)."""
    import requests

    t0 = time.perf_counter()
    first = None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    with requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan"), time.perf_counter() - t0


def one_run(port: int, model: str, long_tokens: int, interval: float, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    long_prompt = [rng.randrange(100, vocab) for _ in range(long_tokens)]
    done: dict = {}

    def long_request():
        done["ttft_s"], done["total_s"] = completion(port, model, long_prompt, 1, 600)

    t = threading.Thread(target=long_request)
    t.start()
    side = []
    time.sleep(interval)
    while t.is_alive():
        t0 = time.perf_counter()
        side.append(completion(port, model, [rng.randrange(100, vocab) for _ in range(8)], 4, 600))
        time.sleep(max(0.0, interval - (time.perf_counter() - t0)))
    t.join()
    ttft = [s[0] for s in side]
    end = [s[1] for s in side]
    return {"long_s": round(done["total_s"], 3), "side_requests": len(side),
            "side_ttft_s": {"p50": round(statistics.median(ttft), 3), "max": round(max(ttft), 3)} if side else None,
            "side_end_s": {"p50": round(statistics.median(end), 3), "max": round(max(end), 3)} if side else None}


def start_vllm(model: str, budget: int, *extra: str):
    """`vllm serve` (vLLM's OpenAI server) from .venv-vllm, float32, the same step budget, started
    outside the checkout (its kernels/ shadows vLLM's import); frontend_overhead.py uses it too."""
    import requests

    port = serve_local.free_port()
    py = os.path.join(os.path.dirname(HERE), ".venv-vllm", "bin", "python")
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(model), "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-batched-tokens", str(budget),
           "--served-model-name", os.path.basename(model.rstrip("/")), *extra]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1")
    srv = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                return srv, port
        except requests.RequestException:
            pass
        if srv.poll() is not None:
            raise SystemExit("vllm serve exited before it was ready")
        time.sleep(1)
    raise SystemExit("vllm serve did not start")


def drain(server) -> None:
    """Keep reading a server's output so its pipe never fills."""
    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--long-tokens", type=int, default=7700)
    ap.add_argument("--variants", default="default,--long-prefill-token-threshold 0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--vllm-model", help="vLLM's checkpoint (default: --model)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "long_prompt_neighbours.json"))
    args = ap.parse_args()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size if os.path.isdir(args.model) else 32000
    name = os.path.basename(args.model.rstrip("/"))
    servers: dict[str, tuple] = {}
    try:
        for variant in args.variants.split(","):
            extra = () if variant == "default" else tuple(variant.split())
            srv, http, _ = serve_local.start_server(args.model, 1, *extra)
            drain(srv)
            servers[f"folio {variant}"] = (srv, http, name)
        if args.vllm:
            srv, port = start_vllm(args.vllm_model or args.model, 2048)
            servers["vllm serve"] = (srv, port, os.path.basename((args.vllm_model or args.model).rstrip("/")))
        order = list(servers)
        runs: dict[str, list] = {k: [] for k in order}
        for r in range(args.rounds):
            for k in order + order[::-1]:
                _, port, model = servers[k]
                res = one_run(port, model, args.long_tokens, args.interval, vocab, seed=len(runs[k]))
                print(k, json.dumps(res), flush=True)
                runs[k].append(res)
    finally:
        for k, (srv, _, _) in servers.items():
            if k.startswith("folio"):
                serve_local.stop_server(srv)
            else:
                os.killpg(srv.pid, 15)
                srv.wait(60)
    summary = {k: {"long_s_median": statistics.median(x["long_s"] for x in v),
                   "side_ttft_p50_s": statistics.median(x["side_ttft_s"]["p50"] for x in v if x["side_ttft_s"]),
                   "side_ttft_max_s": max(x["side_ttft_s"]["max"] for x in v if x["side_ttft_s"])}
               for k, v in runs.items()}
    out = {"benchmark": "long_prompt_neighbours", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python " + " ".join(sys.argv), "long_tokens": args.long_tokens, "interval_s": args.interval,
           "runs": runs, "summary": summary}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
